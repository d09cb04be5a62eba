"""FFN replicas on the attention side: use one live replica of the FFN rank, fail over when it is lost.

An FFN process holds no request state: whatever it was computing, another
process with the same weights computes again from the same input. With
``afd.ffn_replicas = N``, replica ``K`` of FFN rank ``f`` is an ordinary world
of its own at ``afd.port + K * afd.replica_port_stride`` (``afd ffn serve
--replica K``), on ``afd.replica_hosts[K]`` where given (:func:`replica_world`).
:class:`FailoverConnector` is what an attention rank's runtime builds then
(:func:`afd_sdk.runtime.session.build_connector`): it wraps one
connector per replica, built on demand, and forwards the data path to the one
in use. When that replica is lost (``PeerLostError``: killed, frozen past
``timeout_s``, unreachable), it

1. lets every stage thread leave the lost connector (each returns with its
   result, or with the same ``PeerLostError``);
2. opens the next replica in order ``K+1, K+2, …`` (mod ``N``) with a handshake
   deadline of ``timeout_s`` (a dead standby costs one deadline);
3. re-announces the current step with ``resume_layers`` (per stage, the layer
   it was waiting for or will send next) and re-sends every stage's in-flight
   hidden states — the caller keeps them untouched until their output returns
   (the ``send_attn_output`` contract);
4. and lets the waiting threads receive from the new replica.

Every attention rank of one FFN rank walks the same order, so the peers of a
fan-in meet on the same replica. Only when no replica answers is the
``PeerLostError`` raised to the caller, naming each replica's failure.

While open it also pings every replica's beacon (:mod:`afd_sdk.runtime.replica_beacon`), so that
``failover_stats.live`` (``afd_ffn_replicas_live``) says how many replicas it could still fail over to.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from afd_sdk.config import AFDConfig
from afd_sdk.connector import AFDConnector, ConnectorContext, ControlPlane, LostPeer
from afd_sdk.control.endpoint import heartbeat_interval_s
from afd_sdk.errors import ConnectorError, PeerLostError
from afd_sdk.metrics import FailoverStats
from afd_sdk.runtime.replica_beacon import ReplicaProbe, beacon_address
from afd_sdk.wire import A2FPayload, ControlPayload, TransferMetadata

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["FailoverConnector", "replica_port", "replica_world"]


def replica_world(cfg: AFDConfig, replica: int, **changes: Any) -> AFDConfig:
    """Replica ``replica``'s world: ``afd.port`` shifted by the stride, ``afd.host`` its ``replica_hosts`` entry
    where given, ``ffn_replicas`` 1 (a replica is an ordinary world), and ``changes``.

    Called by the attention side for each replica it opens and by ``afd ffn serve --replica K``; ``cfg`` is the
    deployment's config, validated with its replica set.
    """
    host = {} if cfg.replica_hosts is None else {"host": cfg.replica_hosts[replica]}
    port = replica_port(cfg.port, replica, cfg.replica_port_stride)
    return cfg.replace(port=port, ffn_replicas=1, replica_hosts=None, **host, **changes)


def replica_port(port: int, replica: int, stride: int) -> int:
    """The ``afd.port`` of replica ``replica`` of the world at ``port``."""
    return port + replica * stride


class _FailoverPlane(ControlPlane):
    """The control plane a :class:`FailoverConnector` shows the runtime: the replica in use's, plus the step."""

    def __init__(self, owner: FailoverConnector) -> None:
        self.owner = owner

    def init(self) -> None:  # the replica's own plane did the rendezvous and handshake in the owner's open()
        pass

    def close(self) -> None:  # each replica's connector closes its own plane (goodbye) in the owner's release()
        pass

    def send(self, payload: ControlPayload) -> None:
        self.owner._announce(payload)

    def recv(self, timeout_s: float | None = None) -> ControlPayload | None:
        raise ConnectorError("ControlPlane.recv() is an ffn-side call; a FailoverConnector serves attention ranks")

    def apply(self, payload: ControlPayload) -> None:
        super().apply(payload)
        self.owner._current_plane().apply(payload)

    def lost_peers(self) -> tuple[LostPeer, ...]:
        owner = self.owner
        inner = owner._inner
        if owner._dead is not None or (owner._broken and owner._lost_at):
            # failing over, or no replica left: the world is not served right now
            since = time.monotonic() - owner._lost_at
            return (LostPeer(f"ffn rank {owner._ffn_rank()} (replica {owner._replica})", "", since),)
        return () if inner is None else inner.lost_peers()


class FailoverConnector(AFDConnector):
    """An attention rank's connector over ``replicas`` FFN replicas (worlds), one in use at a time.

    ``make(k, failover)`` builds (does not ``init``) the wrapped connector class
    for replica ``k``, at start-up or for a failover (a shorter handshake);
    ``handshake_s`` bounds a failover's handshake with one replica. Built by
    the runtime, never registered: its name, capabilities and metrics labels
    are the wrapped connector's. Thread-safe for the runner's stage threads
    (one thread per stage), like the connectors it wraps.
    """

    def __init__(
        self,
        context: ConnectorContext,
        make: Callable[[int, bool], AFDConnector],
        replicas: int,
        *,
        handshake_s: float,
    ) -> None:
        super().__init__(context)
        if context.config.role != "attention":
            raise ConnectorError("FailoverConnector serves attention ranks; an FFN replica is an ordinary world")
        self._make = make
        self._first: AFDConnector | None = make(0, False)  # constructing opens nothing; it names this connector
        self._name = self._first.display_name
        self.capabilities = self._first.capabilities  # type: ignore[misc]  # the wrapped class's, for the runtime
        self.replicas = replicas
        self.handshake_s = handshake_s
        self._inner: AFDConnector | None = None
        self._replica = 0
        self._cond = threading.Condition()
        self._inside = 0  # stage threads inside a call of the replica in use
        self._broken = False  # the replica in use was lost; a failover is due or running
        self._dead: PeerLostError | None = None  # no replica left: every later call raises this
        self._lost_at = 0.0
        self._step: ControlPayload | None = None
        self._inflight: dict[int, tuple[torch.Tensor, TransferMetadata, Mapping[str, torch.Tensor] | None]] = {}
        self._next_layer: dict[int, int] = {}
        self._closers: list[threading.Thread] = []
        #: failovers so far, the replica in use and the stall of each failover (read by ``/metrics``)
        self.failover_stats = FailoverStats(replicas)
        self._stall_from: float | None = None
        self._probe: ReplicaProbe | None = None  # pings every replica's beacon while open (failover_stats.live)

    # --- identity: the wrapped connector's ------------------------------------------------------

    @property
    def display_name(self) -> str:
        return self._name

    @property
    def replica(self) -> int:
        """The replica in use."""
        return self._replica

    # --- lifecycle --------------------------------------------------------------------------------

    def open(self) -> None:
        """Meet replica 0 with the full ``connect_timeout_s`` (start-up: either side may come first)."""
        conn, self._first = self._first or self._make(0, False), None
        try:
            conn.init()
        except BaseException:
            conn.close()
            raise
        self._inner, self._replica = conn, 0
        self._broken, self._dead = False, None
        self.attach_control_plane(_FailoverPlane(self))
        # how many replicas this rank could still fail over to: each replica's beacon, pinged at the heartbeat
        # interval (a replica's control socket would count the probe as an attention peer)
        ffn = self._ffn_rank()
        beacons = [beacon_address(replica_world(self.config, k), ffn) for k in range(self.replicas)]
        self._probe = ReplicaProbe(beacons, heartbeat_interval_s(self.config.timeout_s), self._live_changed)

    def _live_changed(self, live: int | None) -> None:
        """The probe's count changed (on its thread): the gauge, and a line when a replica stops or starts answering."""
        before, self.failover_stats.live = self.failover_stats.live, live
        if live is None:
            return
        if before is None:  # the first count: worth a line only when a replica is missing from the start
            if live < self.replicas:
                logger.warning("afd: %d of %d replicas of ffn rank %d answer", live, self.replicas, self._ffn_rank())
            return
        log = logger.warning if live < before else logger.info
        log("afd: %d of %d replicas of ffn rank %d answer (%d before)", live, self.replicas, self._ffn_rank(), before)

    def release(self) -> None:
        inner, self._inner = self._inner, None
        probe, self._probe = self._probe, None
        try:
            if inner is not None:
                inner.close()
        finally:
            try:
                if probe is not None:
                    self.failover_stats.live = None
                    probe.close()
            finally:
                for t in self._closers:
                    t.join(timeout=30.0)  # a lost replica's connector closes with its lingers (1 s) at most
                self._closers.clear()
                self._inflight.clear()

    def _current_plane(self) -> ControlPlane:
        inner = self._inner
        if inner is None:
            raise ConnectorError("FailoverConnector is not initialised; call init() first")
        return inner.require_control_plane()

    # --- the step and the data path -----------------------------------------------------------------

    def _announce(self, payload: ControlPayload) -> None:
        """The runner's step announcement: remembered (a failover re-announces it), then sent to the replica."""
        with self._cond:
            self._await_failover()
            self._step = payload
            self._next_layer = {}
            self._inflight.clear()  # what an aborted step left is not this step's
            inner = self._enter()
        plane = inner.require_control_plane()
        try:
            plane.send(payload)
            lost = plane.lost_peers()
            if lost:  # the replica closed between steps (a goodbye, a drop seen while idle)
                raise PeerLostError(f"ffn replica {self._replica} left between steps: {lost[0]}")
        except PeerLostError as exc:
            self._lost(inner, exc)  # the failover announces the step to the next replica
        except BaseException:
            self._leave()
            raise
        else:
            self._leave()

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        with self._cond:
            self._await_failover()
            self._inflight[metadata.stage_idx] = (hidden_states, metadata, extras)
            inner = self._enter()
        try:
            inner.send_attn_output(hidden_states, metadata, extras=extras)
        except PeerLostError as exc:
            self._lost(inner, exc)  # in flight: the failover re-sends it to the next replica
        except BaseException:
            with self._cond:
                self._inflight.pop(metadata.stage_idx, None)  # refused, not sent: nothing to replay
                self._leave_locked()
            raise
        else:
            self._leave()

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        while True:
            with self._cond:
                self._await_failover()
                inner = self._enter()
            try:
                out = inner.recv_ffn_output(ref_tensor, stage_idx)
            except PeerLostError as exc:
                self._lost(inner, exc)
                continue  # on the replica the failover chose
            except BaseException:
                self._leave()
                raise
            with self._cond:
                sent = self._inflight.pop(stage_idx, None)
                if sent is not None:
                    self._next_layer[stage_idx] = sent[1].layer_idx + 1
                if self._stall_from is not None and inner is self._inner:
                    self.failover_stats.observe_stall(time.monotonic() - self._stall_from)
                    self._stall_from = None
                self._leave_locked()
            return out

    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        raise ConnectorError("recv_attn_output() is an ffn-side call; a FailoverConnector serves attention ranks")

    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        raise ConnectorError("send_ffn_output() is an ffn-side call; a FailoverConnector serves attention ranks")

    # --- failover -----------------------------------------------------------------------------------

    def _enter(self) -> AFDConnector:
        """Under the lock: the replica in use, counted as entered by this thread."""
        inner = self._inner
        if inner is None:
            self.require_initialized()
            raise ConnectorError("FailoverConnector has no replica in use")
        self._inside += 1
        return inner

    def _leave(self) -> None:
        with self._cond:
            self._leave_locked()

    def _leave_locked(self) -> None:
        self._inside -= 1
        if self._broken and self._inside == 0:
            self._cond.notify_all()  # the thread that waits to fail over may go

    def _await_failover(self) -> None:
        """Under the lock: wait while a failover is due or running (bounded: each replica's handshake is)."""
        budget = self.replicas * (self.handshake_s + self.config.timeout_s) + 30.0
        bound = time.monotonic() + budget
        while self._broken:
            remaining = bound - time.monotonic()
            if remaining <= 0:
                raise PeerLostError(f"the failover of ffn rank {self._ffn_rank()} did not finish within {budget:g}s")
            self._cond.wait(min(remaining, 1.0))
        if self._dead is not None:
            raise self._dead

    def _lost(self, inner: AFDConnector, exc: PeerLostError) -> None:
        """A call on ``inner`` raised ``exc``: the last thread out of the lost replica fails over, others wait."""
        with self._cond:
            self._inside -= 1
            if self._dead is not None:
                raise self._dead  # no replica left: a late failure changes nothing
            if inner is self._inner and not self._broken:
                self._broken = True
                self._lost_at = time.monotonic()
                logger.warning(
                    "afd: %s replica %d of ffn rank %d lost (%s); failing over",
                    inner.display_name,
                    self._replica,
                    self._ffn_rank(),
                    exc,
                )
            if inner is not self._inner:
                return  # a failover already replaced it: the caller retries on the new replica
            bound = time.monotonic() + self.config.timeout_s + 5.0
            # the others leave the lost replica within timeout_s (each blocked call has that deadline); once one of
            # them failed over, ``_inside`` counts calls on the new replica: stop waiting then
            while self._inside > 0 and self._broken and self._inner is inner:
                if time.monotonic() >= bound:
                    self._dead = PeerLostError(
                        f"{self._inside} call(s) on lost replica {self._replica} did not return within timeout_s"
                    )
                    self._broken = False
                    self._cond.notify_all()
                    raise self._dead
                self._cond.wait(0.05)
            if self._inner is inner and self._broken:
                self._fail_over(inner, exc)
            if self._dead is not None:
                raise self._dead

    def _ffn_rank(self) -> int:
        return self.world.ffn_for_attention(self.role_rank)  # type: ignore[attr-defined]

    def _fail_over(self, lost: AFDConnector, cause: PeerLostError) -> None:
        """Under the lock, no thread inside ``lost``: open the next live replica and replay the step there."""
        self._retire(lost)
        self._inner = None
        failures = [f"replica {self._replica}: {cause}"]
        try:
            self._next_replica(failures)
        finally:
            if self._inner is None and self._dead is None:  # an error escaped: nobody may wait on a failover
                self._dead = PeerLostError(
                    f"the failover of ffn rank {self._ffn_rank()} failed: " + "; ".join(failures)
                )
                self._broken = False
                self._cond.notify_all()

    def _next_replica(self, failures: list[str]) -> None:
        for hop in range(1, self.replicas):
            k = (self._replica + hop) % self.replicas
            conn: AFDConnector | None = None
            try:
                conn = self._make(k, True)
                conn.init()
                self._replay(conn)
            except Exception as exc:  # any failure of one replica: try the next (each is named in the error)
                failures.append(f"replica {k}: {type(exc).__name__}: {exc}")
                if conn is not None:
                    self._retire(conn)
                continue
            self._inner, self._replica = conn, k
            self._broken = False
            self._stall_from = self._lost_at
            self.failover_stats.observe_failover(k)
            logger.warning(
                "afd: ffn rank %d now served by replica %d (failover %d, %.0f ms after the loss)",
                self._ffn_rank(),
                k,
                self.failover_stats.failovers,
                (time.monotonic() - self._lost_at) * 1000,
            )
            self._cond.notify_all()
            return
        self._dead = PeerLostError(
            f"every replica of ffn rank {self._ffn_rank()} is gone ({self.replicas} replicas): " + "; ".join(failures)
        )
        self._broken = False
        self._cond.notify_all()

    def _replay(self, conn: AFDConnector) -> None:
        """Announce the interrupted step on ``conn`` from where each stage stands, then re-send what was in flight."""
        step = self._step
        if step is None:
            return  # lost before the first step: nothing to replay
        resume = tuple(
            self._inflight[s][1].layer_idx if s in self._inflight else self._next_layer.get(s, 0)
            for s in range(step.num_stages)
        )
        payload = msgspec.structs.replace(step, resume_layers=resume) if any(resume) else step
        logger.warning(
            "afd: replaying step %d on ffn rank %d's next replica from layers %s, re-sending stage(s) %s",
            step.step_idx,
            self._ffn_rank(),
            list(resume),
            sorted(self._inflight),
        )
        plane = conn.require_control_plane()
        plane.send(payload)
        plane.apply(payload)
        for _layer, stage in sorted((md.layer_idx, s) for s, (_, md, _) in self._inflight.items()):
            hidden, md, extras = self._inflight[stage]
            conn.send_attn_output(hidden, md, extras=extras)

    def _retire(self, conn: AFDConnector) -> None:
        """Close ``conn`` on a thread of its own: a lost peer's sockets linger up to 1 s, the step should not."""

        def close() -> None:
            try:
                conn.close()
            except Exception:  # a lost replica's connector: its failure to close changes nothing; say so
                logger.warning("afd: closing a lost replica's %s failed", conn.display_name, exc_info=True)

        t = threading.Thread(target=close, name="afd-retire-replica", daemon=True)
        t.start()
        self._closers = [c for c in self._closers if c.is_alive()]
        self._closers.append(t)
