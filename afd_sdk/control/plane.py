"""``ZmqControlPlane``: rendezvous, handshake, per-step control and liveness over ZMQ.

Any point-to-point transport can use it unchanged: the built-in ZMQ, P2P and
shared-memory connectors do, and so can an RDMA/UCX connector whose author
writes only the data path.

Ports: FFN rank ``f`` binds ``afd.host:afd.port + f`` (``afd.ffn_hosts[f]`` where given; ``F`` ports from
``afd.port``); a connector's own data ports start at ``afd.port + F``.

Layout (FFN-first world): FFN rank ``f`` binds a ROUTER at ``host:port+f``;
each Attention rank connects a DEALER (routing id ``a<rank>``) to the FFN rank
that serves it. Messages are msgspec msgpack (:mod:`afd_sdk.wire`); nothing is
pickled.

Handshake: every Attention rank sends :class:`~afd_sdk.wire.Hello`; either
role may start first, and each waits up to ``afd.connect_timeout_s`` for the
other (logging who is missing), not the exchange deadline ``timeout_s``. The FFN
rank compares each field with its own and answers with its Hello, or with a
``HandshakeReject`` naming the field and both values to *every* peer, so both
sides raise the same ``HandshakeError``.
"""

from __future__ import annotations

import collections
import logging
import time

import msgspec
import zmq

from afd_sdk.connector import ConnectorContext, ControlPlane, LostPeer
from afd_sdk.control.endpoint import ZmqEndpoint, endpoint_address, terminate_context
from afd_sdk.errors import ConnectorError, HandshakeError, PeerLostError, WireFormatError
from afd_sdk.topology import FFNFirstWorld, build_world
from afd_sdk.wire import (
    PROTOCOL_VERSION,
    ControlPayload,
    Goodbye,
    HandshakeReject,
    Heartbeat,
    Hello,
    decode_control,
    encode_control,
)

logger = logging.getLogger(__name__)

__all__ = ["ZmqControlPlane", "compare_hellos", "merge_payloads"]

_COMPARED = ("protocol_version", "connector", "num_attention_ranks", "num_ffn_ranks", "num_stages")
_MODEL_COMPARED = ("architecture", "hidden_size", "dtype", "num_layers", "adapter", "adapter_version")


def compare_hellos(attention: Hello, ffn: Hello) -> tuple[str, str, str] | None:
    """First differing field as ``(field, attention_value, ffn_value)``, or ``None``."""
    for name in _COMPARED:
        a, f = getattr(attention, name), getattr(ffn, name)
        if a != f:
            return name, str(a), str(f)
    for name in _MODEL_COMPARED:
        a, f = getattr(attention.model, name), getattr(ffn.model, name)
        if a != f:
            return name, str(a), str(f)
    return None


def _identity(rank: int) -> bytes:
    return b"a%d" % rank


class ZmqControlPlane(ControlPlane):
    """Control plane for FFN-first connectors (ZMQ data, P2P, shm, any third-party point-to-point transport).

    Construct it in the connector's ``open()`` and hand it to
    ``self.attach_control_plane(...)``, which runs :meth:`init` (rendezvous +
    handshake); the connector's base ``close()`` closes it (goodbye). Arguments:

    * ``context``: the connector's :class:`~afd_sdk.connector.ConnectorContext`
      (role, rank, config, model fingerprint and world);
    * ``connector_name``: compared at handshake, so both roles run the same connector;
    * ``transport``: ``"tcp"`` (binds only ``afd.host``) or ``"ipc"`` (Unix
      sockets under ``ipc_dir``);
    * ``zmq_context``: share the connector's ``zmq.Context`` (the connector
      terminates it) instead of one of the plane's own.

    It binds ``afd.port + ffn_rank`` on the FFN side; data endpoints of the
    connector must start at ``afd.port + num_ffn_ranks``. Not thread-safe: the
    runtime uses it from its main thread only.
    """

    def __init__(
        self,
        context: ConnectorContext,
        *,
        connector_name: str,
        transport: str = "tcp",
        ipc_dir: str | None = None,
        zmq_context: zmq.Context | None = None,
    ) -> None:
        self.context = context
        self.config = context.config
        self.connector_name = connector_name
        self.transport = transport
        self.ipc_dir = ipc_dir
        self._shared_ctx = zmq_context  # the owner's context, or None: then one of our own, terminated on close
        self._own_ctx: zmq.Context | None = None
        world = context.world or build_world("ffn_first", self.config.num_attention_ranks, self.config.num_ffn_ranks)
        if not isinstance(world, FFNFirstWorld):
            raise ConnectorError(f"ZmqControlPlane serves FFN-first worlds; the context's world is {world.layout!r}")
        self.world: FFNFirstWorld = world
        self._endpoint: ZmqEndpoint | None = None
        self._peers: tuple[int, ...] = ()
        self._goodbyes: set[bytes] = set()
        # per attention peer, payloads of steps not served yet: a peer whose stages are all empty
        # (P2P skips zero-token transfers) may announce step k+1 before the others announced step k
        self._queued: dict[bytes, collections.deque[ControlPayload]] = {}
        self.peer_closed = False  # attention side: the FFN said goodbye
        self.peer_goodbye = ""  # its reason: "closed", or "drained" (POST /drain on its ops endpoint)
        self._hb_seq = 0

    # --- helpers ------------------------------------------------------------

    def hello(self) -> Hello:
        cfg = self.config
        return Hello(
            protocol_version=PROTOCOL_VERSION,
            role=cfg.role,
            role_rank=self.context.role_rank,
            num_attention_ranks=cfg.num_attention_ranks,
            num_ffn_ranks=cfg.num_ffn_ranks,
            connector=self.connector_name,
            model=self.context.model,
            num_stages=cfg.num_stages,
        )

    def address(self, ffn_rank: int) -> str:
        return endpoint_address(
            self.transport, self.config.ffn_host(ffn_rank), self.config.port + ffn_rank, self.ipc_dir, f"ctl{ffn_rank}"
        )

    @property
    def peers(self) -> tuple[int, ...]:
        """Attention peers (FFN side) or the one FFN rank (Attention side)."""
        return self._peers

    def _ep(self) -> ZmqEndpoint:
        if self._endpoint is None:
            raise ConnectorError("ZmqControlPlane is not initialised; the connector's init() must run first")
        return self._endpoint

    # --- lifecycle ----------------------------------------------------------

    def init(self) -> None:
        if self._endpoint is not None:
            raise ConnectorError("ZmqControlPlane.init() called twice without close()")
        zctx = self._shared_ctx
        if zctx is None:
            zctx = self._own_ctx = zmq.Context(io_threads=1)
        rank = self.context.role_rank
        self._goodbyes = set()
        self._queued = {}
        self.peer_closed = False
        if self.config.role == "ffn":
            self._peers = self.world.attention_for_ffn(rank)
            self._endpoint = ZmqEndpoint(
                zctx,
                "bind",
                self.address(rank),
                timeout_s=self.config.timeout_s,
                peer_name="attention peer",
                resolve_wait_s=self.config.connect_timeout_s,  # the rendezvous' patience for the name too
                watch=True,
            )
            self._handshake_ffn()
        else:
            ffn = self.world.ffn_for_attention(rank)
            self._peers = (ffn,)
            self._endpoint = ZmqEndpoint(
                zctx,
                "connect",
                self.address(ffn),
                timeout_s=self.config.timeout_s,
                identity=_identity(rank),
                peer_name=f"ffn rank {ffn}",
                watch=True,  # /readyz knows an idle world's FFN is gone within the heartbeat timeout
            )
            self._handshake_attention()

    def _handshake_ffn(self) -> None:
        ep = self._ep()
        mine = self.hello()
        expected = {_identity(r): r for r in self._peers}
        got: dict[bytes, Hello] = {}
        deadline = time.monotonic() + self.config.connect_timeout_s
        while len(got) < len(expected):
            ep.await_peer(
                deadline,
                self.config.connect_timeout_s,
                lambda: f"hello of attention ranks {sorted(set(expected.values()) - set(map(expected.get, got)))}",
                stop=self._stop_requested,  # a drained standby ends here: no peer is coming to it
            )
            ident, data = ep.sock.recv_multipart()
            msg = decode_control(data)
            if not isinstance(msg, Hello):
                raise WireFormatError(f"expected a hello during handshake, got {type(msg).__name__}")
            if msg.role != "attention":
                self._reject_all([ident, *got], "role", msg.role, "ffn")
            if ident not in expected:
                self._reject_all(
                    [ident, *got],
                    "role_rank",
                    str(msg.role_rank),
                    f"one of {sorted(expected.values())} (served by ffn rank {self.context.role_rank})",
                )
            diff = compare_hellos(msg, mine)
            if diff is not None:
                self._reject_all([ident, *got], *diff)
            got[ident] = msg
        reply = encode_control(mine)
        for ident in got:
            ep.sock.send_multipart([ident, reply])

    def _reject_all(self, idents: list[bytes], field: str, attention: str, ffn: str) -> None:
        reject = encode_control(HandshakeReject(field, attention, ffn))
        for ident in idents:
            try:
                self._ep().sock.send_multipart([ident, reject])
            except zmq.ZMQError as exc:  # that peer is gone already; it fails on its own deadline
                logger.debug("handshake reject to %r not delivered: %s", ident, exc)
        raise HandshakeError(field, attention, ffn)

    def _handshake_attention(self) -> None:
        ep = self._ep()
        mine = self.hello()
        ep.sock.send(encode_control(mine))
        budget = self.config.connect_timeout_s
        ep.await_peer(time.monotonic() + budget, budget, lambda: "handshake reply")
        msg = decode_control(ep.sock.recv())
        if isinstance(msg, HandshakeReject):
            raise HandshakeError(msg.field, msg.attention, msg.ffn)
        if not isinstance(msg, Hello):
            raise WireFormatError(f"expected a hello during handshake, got {type(msg).__name__}")
        diff = compare_hellos(mine, msg)
        if diff is not None:
            raise HandshakeError(*diff)

    def close(self) -> None:
        ep, self._endpoint = self._endpoint, None
        try:
            if ep is not None:
                self._say_goodbye(ep)
                ep.close()
        finally:
            if self._own_ctx is not None:
                # returns once the sockets are gone (the port is free for a re-init), within a deadline
                what = f"the control plane ({self.config.role} rank {self.context.role_rank})"
                terminate_context(self._own_ctx, what)
                self._own_ctx = None

    def _say_goodbye(self, ep: ZmqEndpoint) -> None:
        bye = encode_control(Goodbye("drained" if self.stop_requested else "closed"))
        if self.config.role == "attention":
            targets: list[list[bytes]] = [[bye]]
        else:
            targets = [[_identity(r), bye] for r in self._peers if _identity(r) not in self._goodbyes]
        for frames in targets:
            try:
                ep.sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # that peer is already gone (or the socket is failing): closing is what matters
                logger.debug("goodbye to %r not delivered: %s", frames[0], exc)

    # --- steps ----------------------------------------------------------------

    def send(self, payload: ControlPayload) -> None:
        if self.config.role != "attention":
            raise ConnectorError("ControlPlane.send() is an attention-side call")
        self.poll_peer()
        if self.peer_closed:  # the FFN rank is gone for this world (a failover takes it as a lost peer)
            raise PeerLostError(
                f"ffn rank {self._peers[0]} said goodbye ({self.peer_goodbye}); no further steps can be sent"
            )
        self._ep().sock.send(encode_control(payload))

    def heartbeat(self) -> None:
        """Send an application-level heartbeat (ZMTP heartbeats already run underneath)."""
        self._hb_seq += 1
        self._ep().sock.send(encode_control(Heartbeat(self._hb_seq)))

    def check_alive(self, what: str) -> None:
        """Raise ``PeerLostError`` naming ``what`` when a peer's connection dropped; return at once otherwise.

        Called by connectors whose data path waits outside this plane's socket
        (one-sided writes, shared memory), every few milliseconds of a wait; a
        dead, frozen (heartbeats stop) or unreachable peer shows here. On the FFN
        side peers that said goodbye do not count; on the attention side an FFN
        rank's goodbye (it closed or was drained) raises too: the data awaited
        will not come. Not thread-safe, like the plane: callers serialise.
        """
        if self.config.role == "ffn":
            self._ep().check(None, what, len(self._goodbyes))
            return
        self.poll_peer()
        if self.peer_closed:  # the FFN rank left (closed or drained): what this side waits for is not coming
            ffn = self._peers[0]
            raise PeerLostError(f"ffn rank {ffn} said goodbye ({self.peer_goodbye}) while waiting for {what}")
        self._ep().check(None, what, 0)

    def lost_peers(self) -> tuple[LostPeer, ...]:
        """The FFN rank (attention side) or the attention peers (FFN side) whose connection dropped.

        The control socket's heartbeats (every ``timeout_s / 6``, at most 2 s; a
        peer is dropped after three missed) run in libzmq's I/O thread and a
        watching thread counts the drops, so this answers while the world is
        idle. A ROUTER cannot tell which attention rank dropped: the FFN side
        names all of its peers.
        """
        ep = self._endpoint
        if ep is None:
            return ()
        if self.config.role == "ffn":
            lost = ep.lost_for(len(self._goodbyes))
            ranks = list(self._peers)
            peer = f"attention ranks {ranks}" if len(ranks) > 1 else f"attention rank {ranks[0]}"
        else:
            lost = ep.lost_for(int(self.peer_closed))
            peer = f"ffn rank {self._peers[0]}"
        return () if lost is None else (LostPeer(peer, ep.address, lost),)

    def _stop_requested(self) -> bool:
        return self.stop_requested

    def poll_peer(self) -> None:
        """Attention side: read pending messages from the FFN rank without blocking."""
        ep = self._ep()
        while ep.sock.poll(0, zmq.POLLIN):
            msg = decode_control(ep.sock.recv())
            if isinstance(msg, Goodbye):
                self.peer_closed = True
                self.peer_goodbye = msg.reason

    def recv(self, timeout_s: float | None = None) -> ControlPayload | None:
        """FFN side: the next step, merged over attention peers in fan-in order.

        ``timeout_s=None`` waits for the first payload as long as every peer is
        alive (an idle server is not an error); once one peer has announced a
        step, the others must follow within the config's ``timeout_s``.
        """
        if self.config.role != "ffn":
            raise ConnectorError("ControlPlane.recv() is an ffn-side call")
        ep = self._ep()
        order = [_identity(r) for r in self._peers]
        queued = self._queued
        for ident in order:
            queued.setdefault(ident, collections.deque())
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if all(queued[i] for i in order):
                break
            waiting = [i for i in order if not queued[i]]
            if all(i in self._goodbyes for i in waiting):
                if len(waiting) == len(order):
                    return None  # every peer said goodbye and nothing is left to serve
                gone = [i.decode() for i in waiting]
                raise PeerLostError(f"attention peer(s) {gone} said goodbye while the others started a step")
            started = any(queued[i] for i in order)
            if not started and self.stop_requested:
                return None  # drained between steps: no peer has begun to announce one
            if started and deadline is None:
                deadline = ep.deadline()  # a step has begun: the others must follow within timeout_s
            ep.wait(
                deadline,
                "control payload for the next step",
                tolerated_disconnects=len(self._goodbyes),
                stop=None if started else self._stop_requested,
            )
            if not ep.sock.poll(0, zmq.POLLIN):
                continue  # woken by request_stop()
            ident, data = ep.sock.recv_multipart()
            msg = decode_control(data)
            if isinstance(msg, Goodbye):
                self._goodbyes.add(ident)
            elif isinstance(msg, ControlPayload):
                if ident not in queued:
                    raise WireFormatError(f"control payload from {ident.decode(errors='replace')}, not a peer")
                queued[ident].append(msg)
            elif isinstance(msg, Heartbeat):
                continue
            else:
                raise WireFormatError(f"unexpected {type(msg).__name__} from {ident.decode()} after the handshake")
        return merge_payloads([queued[i].popleft() for i in order])


def merge_payloads(payloads: list[ControlPayload]) -> ControlPayload:
    """Merge per-peer payloads (one token count per stage each) into one, fan-in order."""
    first = payloads[0]
    for p in payloads[1:]:
        # resume_layers: after a failover every peer of one FFN rank resumes the step at the same layers; a fault
        # between the replies of one layer to two peers leaves them apart, which one FFN step cannot serve
        for field in ("step_idx", "num_stages", "num_layers", "resume_layers"):
            if getattr(p, field) != getattr(first, field):
                raise WireFormatError(f"attention peers disagree on {field}: {[getattr(q, field) for q in payloads]}")
    counts = tuple(tuple(c for p in payloads for c in p.stage_token_counts[s]) for s in range(first.num_stages))
    return msgspec.structs.replace(
        first,
        stage_token_counts=counts,
        max_num_tokens=max(p.max_num_tokens for p in payloads),
        is_warmup=any(p.is_warmup for p in payloads),
        is_graph_capturing=any(p.is_graph_capturing for p in payloads),
    )
