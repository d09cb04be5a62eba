"""The ``portable`` CAM backend: dispatch/combine over torch.distributed point-to-point.

Gloo for CPU tensors, NCCL for CUDA; one process group per stage over the
Attention-first world, built on the handshake's ``TCPStore``.

Per MoE layer and stage, Attention rank ``a`` sorts its ``n × top_k``
(token, expert) pairs by expert and sends every FFN rank ``f`` one int64
header ``[kind, layer, rows, rows per local expert...]`` and, when ``rows > 0``,
those hidden-state rows. FFN rank ``f`` receives every live Attention rank's
header, then the rows; regroups them by local expert (the work item); runs
its experts; and sends each Attention rank its rows' unweighted outputs back
in the order they came. Attention scatters the rows back to (token, slot) and
sums them with the top-k weights. A header of kind ``GOODBYE`` (sent on stage
0 by ``close()``) retires an Attention rank; when none is left the FFN side's
``recv_work_item`` returns ``None``.

Between steps (the next header is a step's first MoE layer on its stage) an FFN
rank may idle for as long as the engine has no requests. A Gloo wait cannot
time out without breaking its pair, so that wait runs on a helper thread with
no practical deadline while the caller watches the peers' heartbeats
(:mod:`afd_connectors.cam.liveness`): a peer that died, froze or was cut off
ends the wait with ``PeerLostError`` within ``timeout_s / 2``, and once the
lowest live rank's header is in, the others must follow within ``timeout_s``.
Within a step every wait has the plain ``timeout_s`` deadline.

With redundant experts a restarted FFN rank rejoins the running world over groups of its own with each
Attention rank (:mod:`afd_connectors.cam.rejoin`); :meth:`PortableCamBackend._link` and
:meth:`PortableCamBackend._peer` pick the group and the peer's index in it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from afd_connectors.cam.rejoin import JoinAdmission, is_running, join_running_world, mark_formed
from afd_connectors.cam.rendezvous import open_store
from afd_connectors.cam.routing import ExpertRouting
from afd_connectors.cam.watched_wait import WatchedWaiter
from afd_sdk.control import DeviceBuffers, shutdown_groups, stage_groups, wait_works
from afd_sdk.dispatch import FFNWorkItem
from afd_sdk.errors import ConnectorError, PeerLostError, WireFormatError

if TYPE_CHECKING:
    from afd_connectors.cam.backend import CamHost

__all__ = ["PortableCamBackend"]

logger = logging.getLogger(__name__)

DATA, GOODBYE, REDO = 0, 1, 2
_TAG_HEADER, _TAG_ROWS, _TAG_OUT = 0, 1, 2
_HEADER_FIELDS = 3  # kind, layer, rows
#: the Gloo deadline of a wait between steps: liveness ends it long before (a year; gloo counts milliseconds)
_IDLE_GLOO_S = 365 * 24 * 3600.0


@dataclass
class _Dispatch:
    """Attention side: one dispatch awaiting its combine (the connector queues it as the backend's handle)."""

    order: torch.Tensor  # sorted row i came from flat (token * top_k + slot) index order[i]
    works: list[Any]  # sends of headers and rows
    recvs: list[Any]  # expert outputs, posted at dispatch so the FFN's sends never wait for them
    outputs: torch.Tensor  # [rows, hidden] in sorted order, filled by ``recvs``
    buffer: torch.Tensor  # what ``outputs`` views; back to the free list after the combine
    keep: list[torch.Tensor]  # rows first, then the headers
    #: per FFN rank sent to: (ffn rank, first sorted row, rows, its sends, its output's receive, why posting failed)
    peers: list[tuple[int, int, int, list[Any], Any, str | None]]


@dataclass
class _ItemState:
    """FFN side: how to send an item's output back."""

    to_peer_order: torch.Tensor | None  # peer-major row j is expert-grouped row to_peer_order[j]


class PortableCamBackend:
    """torch.distributed implementation of the CAM dispatch/combine semantics."""

    def __init__(self, conn: CamHost) -> None:
        self.conn = conn
        self.world = conn.world
        self.timeout_s = conn.config.timeout_s
        self.device = conn.device
        self.dist_backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.num_attention = self.world.num_attention
        self.hidden = conn.hidden_size
        self.dtype = conn.dtype
        self._store: Any = None
        self._ns = f"afd-cam/{conn.config.port}"  # the world's keys in its store
        self._groups: list[Any] = []
        self._bufs = DeviceBuffers()
        self._free: dict[int, list[torch.Tensor]] = {}  # stage -> output buffers no dispatch uses
        self._inflight: dict[int, tuple[list[Any], list[torch.Tensor]]] = {}
        self._gone: set[int] = set()
        self._header_recvs: dict[int, dict[int, tuple[Any, torch.Tensor]]] = {}  # stage -> peer -> posted recv
        self._flip: dict[tuple[int, int], bool] = {}
        self._last_layer: dict[int, int] = {}  # stage -> layer of its last work item (none yet: between steps)
        self._ready: dict[int, dict[int, list[int]]] = {}  # stage -> peer -> received header waiting its turn
        self._step_end = conn.moe.moe_layers[-1] if conn.moe.moe_layers else None
        self._redundant = self.world.expert_replicas > 1
        self.routing = ExpertRouting(self.world, self.device, conn.name)
        self._abandoned: list[torch.Tensor] = []  # buffers a lost FFN rank may still write into: never reused
        self._waiter: WatchedWaiter | None = None  # waits with heartbeats watched (redundant experts)
        self._in_flight_to: dict[int, int] = {}  # ffn rank -> dispatches not combined yet (redundant experts)
        self._goodbye_due: set[int] = set()  # draining ffn ranks routed around, told once nothing is in flight
        #: this process's incarnation of its FFN rank (0 unless it rejoined a running world)
        self.incarnation = 0
        self._links: dict[int, list[Any]] = {}  # attention: rejoined ffn rank -> its stage groups with this rank
        self._peer_links: dict[int, list[Any]] = {}  # rejoined ffn: attention rank -> its stage groups with it
        self._old_links: list[list[Any]] = []  # attention: links of incarnations lost since
        self._first_moe = conn.moe.moe_layers[0] if conn.moe.moe_layers else None
        self._step = 0  # attention: steps begun (dispatches of the first MoE layer); the same on every rank
        self._admission: JoinAdmission | None = None
        if conn.role == "ffn":
            self._local = self.world.local_experts(conn.role_rank)
            self._header_len = _HEADER_FIELDS + len(self._local)

    # --- lifecycle -----------------------------------------------------------------

    def init(self) -> None:
        if self.dist_backend == "nccl" and not torch.cuda.is_available():
            raise ConnectorError(f"{self.conn.name}: CUDA tensors need NCCL, and torch.cuda.is_available() is False")
        cfg = self.conn.config
        ns = self._ns
        self._store = open_store(self.conn, ns)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._gone.clear()
        if self.conn.role == "ffn" and self._redundant and is_running(self._store, ns):
            self.incarnation, self._peer_links = join_running_world(self.conn, self._store, ns)
            return
        rank, size = self.conn.world_rank, self.world.world_size
        self._groups = stage_groups(
            self._store,
            ns,
            rank,
            size,
            self.dist_backend,
            cfg.timeout_s,
            cfg.num_stages,
            host=cfg.host,
            port=cfg.port,
            interface=cfg.interface,
        )
        if self._redundant and rank == 0:
            mark_formed(self._store, ns)

    def close(self) -> None:
        if self._groups and self.conn.role == "attention":
            self._say_goodbye()
        admission, self._admission = self._admission, None
        if admission is not None:
            admission.close()
        inflight, self._inflight = self._inflight, {}
        for works, _keep in inflight.values():  # the last outputs must reach attention before the groups go
            try:
                self._wait(works, "last expert outputs")
            except PeerLostError as exc:
                logger.debug("%s: last expert outputs not delivered: %s", self.conn.name, exc)
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.close()
        groups, self._groups = self._groups, []
        shutdown_groups(groups, self.conn.name)
        for pair in [*self._links.values(), *self._peer_links.values(), *self._old_links]:
            shutdown_groups(pair, self.conn.name)
        self._links.clear()
        self._peer_links.clear()
        self._old_links.clear()
        self._store = None
        self._bufs.clear()
        self._free.clear()
        self._header_recvs.clear()
        self._flip.clear()
        self._last_layer.clear()
        self._ready.clear()
        self._in_flight_to.clear()
        self._goodbye_due.clear()

    def _say_goodbye(self) -> None:
        """Retire this Attention rank on every FFN rank (stage 0, where each FFN step starts), and on each rejoining
        one whose groups formed (it ends in order instead of losing this rank)."""
        works, keep = [], []
        admission = self._admission
        pending = [] if admission is None else [(f, (groups[0], 1)) for f, groups in admission.formed()]
        for f, (pg, peer) in [*((f, self._link(0, f)) for f in self.routing.targets), *pending]:
            header = torch.zeros(_HEADER_FIELDS + len(self.routing.held[f]), dtype=torch.int64, device=self.device)
            header[0] = GOODBYE
            keep.append(header)
            try:
                works.append(pg.send([header], peer, _TAG_HEADER))
            except RuntimeError as exc:
                logger.debug("%s: goodbye to ffn rank %d not sent: %s", self.conn.name, f, exc)
        try:
            self._wait(works, "goodbye")
        except PeerLostError as exc:  # the FFN side is gone already: nothing to tell it
            logger.debug("%s: goodbye not delivered: %s", self.conn.name, exc)

    # --- helpers -------------------------------------------------------------------------

    def _wait(self, works: Sequence[Any], what: str, *args: object) -> None:
        """Wait with the ``timeout_s`` deadline; ``what % args`` names the wait, formatted only on failure."""
        wait_works(works, self.timeout_s, "%s: " + what, self.conn.name, *args)

    def _link(self, stage: int, ffn: int) -> tuple[Any, int]:
        """Attention side: the group that reaches FFN rank ``ffn`` on ``stage``, and its index there."""
        pair = self._links.get(ffn)
        return (self._groups[stage], self.num_attention + ffn) if pair is None else (pair[stage], 1)

    def _peer(self, stage: int, attention: int) -> tuple[Any, int]:
        """FFN side: the group that reaches attention rank ``attention`` on ``stage``, and its index there."""
        pair = self._peer_links.get(attention)
        return (self._groups[stage], attention) if pair is None else (pair[stage], 0)

    def _begin_step(self) -> None:
        """Attention side, before a step's first dispatch (redundant experts): count it, and carry on any
        rejoin (:mod:`afd_connectors.cam.rejoin`); at the agreed step the rejoined rank is routed to again."""
        self._step += 1
        liveness = self.conn.liveness
        if liveness is None:
            return
        admission = self._admission
        if admission is None:
            if not liveness.joining:
                return
            admission = self._admission = JoinAdmission(self.conn, self._store, self._ns, liveness)
        if not admission.pending():
            return
        for ffn, incarnation, groups in admission.at_boundary(self._step, self.routing.lost):
            old = self._links.pop(ffn, None)
            if old is not None:  # an earlier incarnation's: a thread may still wait on it, so shut down at close
                self._old_links.append(old)
            self._links[ffn] = groups
            self._goodbye_due.discard(ffn)
            self._in_flight_to.pop(ffn, None)
            self.routing.restore(ffn)
            liveness.readmit(self.num_attention + ffn, incarnation)
            stats = self.conn.failover_stats
            if stats is not None:
                stats.observe_rejoin()
            logger.warning(
                "%s: ffn rank %d rejoined (incarnation %d) at step %d; its experts go to it again (routing epoch %d)",
                self.conn.name,
                ffn,
                incarnation,
                self._step,
                self.routing.epoch,
            )

    # --- attention side ---------------------------------------------------------------------

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int, stage: int
    ) -> _Dispatch:
        routing = self.routing
        if self._redundant:
            if layer == self._first_moe:
                self._begin_step()
            self._watch_heartbeats()
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        # rows grouped by the FFN rank they go to (expert order while every expert goes to its primary)
        key = flat if routing.sort_key is None else routing.sort_key.index_select(0, flat)
        order = torch.argsort(key, stable=True)
        per_expert = torch.bincount(flat, minlength=self.world.num_experts).tolist()
        rows = hidden.index_select(0, order // k) if k > 1 else hidden.index_select(0, order)
        buffer = self._output_buffer(stage, rows.shape[0], hidden)
        outputs = buffer[: rows.shape[0]]
        works, recvs, keep, peers = [], [], [rows], []
        off = 0
        for f in routing.targets:
            counts = routing.counts(f, per_expert)
            total = sum(counts)
            header = torch.tensor([DATA, layer, total, *counts], dtype=torch.int64, device=self.device)
            keep.append(header)
            sends, recv, error = self._post(stage, f, header, rows[off : off + total], outputs[off : off + total])
            works += sends
            if recv is not None:
                recvs.append(recv)
            peers.append((f, off, total, sends, recv, error))
            off += total
        if self._redundant:
            for f in routing.targets:
                self._in_flight_to[f] = self._in_flight_to.get(f, 0) + 1
        return _Dispatch(order, works, recvs, outputs, buffer, keep, peers)

    def _post(
        self, stage: int, ffn: int, header: torch.Tensor, rows: torch.Tensor, outputs: torch.Tensor
    ) -> tuple[list[Any], Any, str | None]:
        """Post the sends of ``header`` and ``rows`` to ``ffn`` and the receive of its ``outputs``.

        The receive goes up first, so the FFN's send never waits for it. With redundant experts a rank
        whose connection is already closed is reported (the third item), not raised: the combine fails it over.
        """
        pg, peer = self._link(stage, ffn)
        sends: list[Any] = []
        recv = None
        try:
            if rows.shape[0]:
                recv = pg.recv([outputs], peer, _TAG_OUT)
            sends.append(pg.send([header], peer, _TAG_HEADER))
            if rows.shape[0]:
                sends.append(pg.send([rows], peer, _TAG_ROWS))
        except RuntimeError as exc:
            if not self._redundant:
                raise PeerLostError(f"{self.conn.name}: dispatch to ffn rank {ffn} failed: {exc}") from exc
            return sends, recv, str(exc)
        return sends, recv, None

    def _output_buffer(self, stage: int, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A receive buffer of at least ``rows`` rows; reused once its combine is done (FIFO depth varies)."""
        free = self._free.setdefault(stage, [])
        for i, buf in enumerate(free):
            if buf.shape[0] >= rows and buf.dtype == like.dtype and buf.device == like.device:
                return free.pop(i)
        return torch.empty((max(rows, 1), self.hidden), dtype=like.dtype, device=like.device)

    def combine(
        self,
        ref_tensor: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layer: int,
        stage: int,
        d: _Dispatch,
    ) -> torch.Tensor:
        n, k = topk_ids.shape
        if self._redundant:
            abandon = self._combine_redundant(topk_ids, layer, stage, d)
            for f, *_rest in d.peers:
                self._in_flight_to[f] -= 1
            if self._goodbye_due:
                self._say_goodbye_to_drained()
        else:
            self._wait(d.works, "dispatch of layer %d, stage %d", layer, stage)
            self._wait(d.recvs, "expert outputs of layer %d, stage %d", layer, stage)
            abandon = False
        # back to (token, slot) order with one gather, then as the native experts module does: weight each
        # expert output, cast, sum over the top-k (slot by slot: a reduction kernel is slower for small k)
        y = d.outputs.index_select(0, torch.argsort(d.order)).view(n, k, self.hidden)
        (self._abandoned if abandon else self._free.setdefault(stage, [])).append(d.buffer)
        weighted = (y * topk_weights.unsqueeze(-1)).to(ref_tensor.dtype)
        out = weighted[:, 0]
        for slot in range(1, k):
            out = out + weighted[:, slot]
        return out

    # --- attention side with redundant experts ------------------------------------------------

    def _combine_redundant(self, topk_ids: torch.Tensor, layer: int, stage: int, d: _Dispatch) -> bool:
        """Wait for each FFN rank's part on its own; re-dispatch the parts of the lost ones to their experts'
        other holders. True when a lost rank's receive was left posted (its buffer must not be reused)."""
        routed_around = self.routing.lost
        parts = [
            (f, sends if recv is None else [*sends, recv])
            for f, _off, _total, sends, recv, error in d.peers
            if error is None and f not in routed_around
        ]
        failed = self._wait_parts(parts, "%s: exchange of layer %d, stage %d", self.conn.name, layer, stage)
        lost = [
            (f, off, total, error or failed.get(f) or "lost before this exchange completed")
            for f, off, total, _sends, _recv, error in d.peers
            if error is not None or f in failed or f in routed_around
        ]
        if not lost:
            return False
        began = time.monotonic()
        for f, _off, _total, why in lost:
            self._fail_over(f, why)
        moved = [torch.arange(off, off + total) for _f, off, total, _why in lost if total]
        if moved:
            positions = torch.cat(moved).to(d.order.device)
            self._redispatch(positions, topk_ids.reshape(-1), layer, stage, d)
            logger.warning(
                "%s: re-dispatched %d rows of layer %d, stage %d to their experts' other holders in %.1f ms",
                self.conn.name,
                positions.numel(),
                layer,
                stage,
                1e3 * (time.monotonic() - began),
            )
        stats = self.conn.failover_stats
        if stats is not None:
            stats.observe_stall(time.monotonic() - began)
        return True

    def _redispatch(
        self, positions: torch.Tensor, flat_ids: torch.Tensor, layer: int, stage: int, d: _Dispatch
    ) -> None:
        """Send the sorted rows at ``positions`` (their FFN rank was lost) to their experts' live holders as
        ``REDO`` items, and put the outputs where the lost rank's would have gone."""
        routing, rows_all = self.routing, d.keep[0]
        for _ in range(self.world.num_ffn):  # each round loses at least one more rank, or completes
            ids = flat_ids.index_select(0, d.order.index_select(0, positions))
            assert routing.sort_key is not None  # a rank was lost: the table is remapped
            sub = torch.argsort(routing.sort_key.index_select(0, ids), stable=True)
            positions, ids = positions.index_select(0, sub), ids.index_select(0, sub)
            per_expert = torch.bincount(ids, minlength=self.world.num_experts).tolist()
            rows = rows_all.index_select(0, positions)
            out = torch.empty_like(rows)
            parts, off = [], 0
            for f in routing.targets:
                counts = routing.counts(f, per_expert)
                total = sum(counts)
                if total:
                    header = torch.tensor([REDO, layer, total, *counts], dtype=torch.int64, device=self.device)
                    sends, recv, error = self._post(stage, f, header, rows[off : off + total], out[off : off + total])
                    parts.append((f, off, total, sends, recv, error, header))
                off += total
            waits = [(f, [*sends, recv]) for f, _off, _total, sends, recv, error, _header in parts if error is None]
            failed = self._wait_parts(waits, "%s: re-dispatch of layer %d, stage %d", self.conn.name, layer, stage)
            again = []
            for f, off, total, _sends, _recv, error, _header in parts:
                if error is None and f not in failed:
                    d.outputs.index_copy_(0, positions[off : off + total], out[off : off + total])
                    continue
                self._fail_over(f, error or failed[f])
                again.append(positions[off : off + total])
            if not again:
                return
            positions = torch.cat(again)
        raise AssertionError("unreachable: ExpertRouting.lose raises once an expert has no holder left")

    def _wait_parts(self, parts: list[tuple[int, list[Any]]], what: str, *what_args: object) -> dict[int, str]:
        """Wait each FFN rank's part of an exchange; ``{ffn rank: why}`` for the parts that failed or were given up
        (their rank stopped beating: see :mod:`afd_connectors.cam.watched_wait`)."""
        liveness = self.conn.liveness
        if liveness is None:  # not opened through the connector: one plain deadline per part
            failed = {}
            for f, works in parts:
                try:
                    wait_works(works, self.timeout_s, what, *what_args)
                except PeerLostError as exc:
                    failed[f] = str(exc)
            return failed
        if self._waiter is None:
            self._waiter = WatchedWaiter(self.conn.name, liveness, self.num_attention, self.timeout_s)
        return self._waiter.wait_parts(parts, what, *what_args)

    def _fail_over(self, ffn: int, why: str) -> None:
        """Route around ``ffn`` from now on (``PeerLostError`` when that is impossible)."""
        if "Timed out" in why:  # gloo closed every connection of this rank with that timeout
            raise PeerLostError(
                f"{self.conn.name}: ffn rank {ffn} did not answer within afd.timeout_s={self.timeout_s:g}s "
                f"mid-exchange; a Gloo timeout closes every connection of this rank, so redundant experts cannot "
                f"take over (a rank that dies or freezes between exchanges can): {why}"
            )
        routing = self.routing
        if ffn in routing.lost:
            return
        routing.lose(ffn, why)
        logger.warning(
            "%s: ffn rank %d lost (%s); its experts go to their other holders from now on (routing epoch %d)",
            self.conn.name,
            ffn,
            why,
            routing.epoch,
        )
        world_rank = self.num_attention + ffn
        liveness = self.conn.liveness
        if liveness is not None:
            liveness.retire(world_rank)  # failed over: its silence no longer makes this rank unready
            liveness.fence(world_rank)
        stats = self.conn.failover_stats
        if stats is not None:
            stats.observe_failover(0)

    def _watch_heartbeats(self) -> None:
        """Before a dispatch: route around FFN ranks whose heartbeats stopped (frozen or cut off while idle) and
        those that announced a drain."""
        liveness = self.conn.liveness
        if liveness is None:
            return
        for rank in liveness.lost_ranks():
            if rank - self.num_attention not in self.routing.lost:
                self._fail_over(rank - self.num_attention, f"no heartbeat through {liveness.address}")
        for rank in liveness.draining:
            if rank - self.num_attention not in self.routing.lost:
                self._route_around_drained(rank - self.num_attention)

    def _route_around_drained(self, ffn: int) -> None:
        """``ffn`` is draining: no new dispatch goes there; its goodbye follows its last combine."""
        routing = self.routing
        routing.lose(ffn, "it is draining")  # PeerLostError when an expert would be left without a holder
        logger.warning(
            "%s: ffn rank %d is draining; its experts go to their other holders from now on (routing epoch %d)",
            self.conn.name,
            ffn,
            routing.epoch,
        )
        liveness = self.conn.liveness
        if liveness is not None:
            liveness.retire(self.num_attention + ffn)  # it leaves in order: its silence is not a loss
        stats = self.conn.failover_stats
        if stats is not None:
            stats.observe_failover(0)
        self._goodbye_due.add(ffn)
        self._say_goodbye_to_drained()

    def _say_goodbye_to_drained(self) -> None:
        """Retire this attention rank on each draining FFN rank with nothing of ours in flight there."""
        for f in [f for f in self._goodbye_due if not self._in_flight_to.get(f)]:
            self._goodbye_due.discard(f)
            header = torch.zeros(_HEADER_FIELDS + len(self.routing.held[f]), dtype=torch.int64, device=self.device)
            header[0] = GOODBYE
            pg, peer = self._link(0, f)
            try:
                work = pg.send([header], peer, _TAG_HEADER)
            except RuntimeError as exc:  # it left already: nothing to tell it
                logger.warning("%s: goodbye to draining ffn rank %d not sent: %s", self.conn.name, f, exc)
                continue
            failed = self._wait_parts([(f, [work])], "%s: goodbye to draining ffn rank %d", self.conn.name, f)
            if failed:
                logger.warning("%s: goodbye to draining ffn rank %d not delivered: %s", self.conn.name, f, failed[f])

    # --- ffn side ------------------------------------------------------------------------------

    def recv_work_item(self, stage: int) -> FFNWorkItem | None:
        works, keep = self._inflight.pop(stage, ([], []))
        self._wait(works, "expert outputs of the previous work item, stage %d", stage)
        del keep
        live = [a for a in range(self.num_attention) if a not in self._gone]
        if not live:
            return None
        posted = self._header_recvs.pop(stage, {})
        ready = self._ready.pop(stage, {})  # headers received, not served yet (they came beside a re-dispatch)
        pending = {a: posted.get(a) or self._post_header(stage, a) for a in live if a not in ready}
        if pending:
            works = [pending[a][0] for a in live if a in pending]
            if self._last_layer.get(stage, self._step_end) == self._step_end:
                self._wait_between_steps(works, stage)
            elif self._redundant and self.conn.liveness is not None:
                # mid-step, while the attention ranks may still be giving up a frozen FFN rank (up to 3 beats and
                # one more to look): never a Gloo deadline, which would close this survivor's connections too
                self._wait_between_steps(works, stage, within_s=self.timeout_s + 2 * self.conn.liveness.limit_s)
            else:
                self._wait(works, "next work item of stage %d", stage)
        headers = {a: ready[a] if a in ready else pending[a][1].tolist() for a in live}
        redo = [a for a in live if headers[a][0] == REDO]
        if redo:
            # attention ranks re-dispatch what a lost FFN rank had: served at once, the re-dispatches of one layer
            # together (each rank waits for its own before its next header on any stage, so none may wait behind
            # another's); the other headers keep their turn
            first = min(headers[a][1] for a in redo)
            redo = [a for a in redo if headers[a][1] == first]
            self._ready[stage] = {a: h for a, h in headers.items() if a not in redo}
            headers = {a: headers[a] for a in redo}
        layer: int | None = None
        counts: dict[int, list[int]] = {}
        for a, header in headers.items():
            kind, a_layer, total, *per_expert = header
            if kind == GOODBYE:
                self._gone.add(a)
                if self.conn.liveness is not None:
                    self.conn.liveness.retire(a)  # attention rank a is world rank a
                continue
            if kind not in (DATA, REDO) or total != sum(per_expert) or total < 0:
                raise WireFormatError(f"{self.conn.name}: malformed dispatch header from attention rank {a}")
            if layer is not None and a_layer != layer:
                raise ConnectorError(
                    f"{self.conn.name}: stage {stage} got layer {layer} and layer {a_layer} in one exchange; "
                    "every attention rank must dispatch the same MoE layers in the same order"
                )
            layer = a_layer
            counts[a] = per_expert
        if layer is None:  # every remaining attention rank said goodbye
            return None
        if not redo:
            self._last_layer[stage] = layer
        # the next headers' receives go up now, so the attention side's sends never wait for them
        self._header_recvs[stage] = {a: self._post_header(stage, a) for a in counts}
        peer_rows = [sum(counts.get(a, ())) for a in range(self.num_attention)]
        total = sum(peer_rows)
        recv = self._bufs.get(("rows", stage), total, (self.hidden,), self.dtype, self.device)
        recvs, off = [], 0
        for a, rows in enumerate(peer_rows):
            if rows:
                pg, peer = self._peer(stage, a)
                recvs.append(self._posted(pg.recv, [recv[off : off + rows]], peer, _TAG_ROWS, a))
            off += rows
        self._wait(recvs, "routed tokens of layer %d, stage %d", layer, stage)
        num_local = len(self._local)
        group = [sum(c[e] for c in counts.values()) for e in range(num_local)]
        senders = [a for a in range(self.num_attention) if peer_rows[a]]
        to_peer = None
        hidden = recv
        if len(senders) > 1:  # regroup peer-major rows expert-major; one gather
            starts, off = {}, 0
            for a in range(self.num_attention):
                starts[a] = off
                off += peer_rows[a]
            pieces = []
            for e in range(num_local):
                for a in senders:
                    c = counts[a]
                    if c[e]:
                        begin = starts[a] + sum(c[:e])
                        pieces.append(torch.arange(begin, begin + c[e]))
            gather = torch.cat(pieces).to(self.device)
            hidden = recv.index_select(0, gather)
            to_peer = torch.argsort(gather)  # output row order back to peer-major
        return FFNWorkItem(
            layer_idx=layer,
            stage_idx=stage,
            hidden_states=hidden,
            group_list=torch.tensor(group, dtype=torch.int64),
            expert_start=self._local.start,
            peer_tokens=tuple(peer_rows),
            state=_ItemState(to_peer),
        )

    def _wait_between_steps(self, works: list[Any], stage: int, within_s: float | None = None) -> None:
        """Wait for the next step's headers as long as every peer is alive (see the module docstring).

        With ``within_s`` (mid-step, redundant experts) the same watched wait, bounded by that many seconds.
        """
        liveness = self.conn.liveness
        if liveness is None:  # not opened through the connector: the plain deadline
            self._wait(works, "next work item of stage %d", stage)
            return
        arrived = [0]
        failed: list[PeerLostError] = []
        done = threading.Event()

        def wait_all() -> None:
            try:
                for work in works:
                    wait_works([work], _IDLE_GLOO_S, f"{self.conn.name}: next step's header on stage {stage}")
                    arrived[0] += 1
            except PeerLostError as exc:  # a peer's connection closed: gloo says so at once
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=wait_all, name=f"afd-cam-idle-{stage}", daemon=True).start()
        what = f"the next step's first work item on stage {stage}"
        deadline: float | None = None if within_s is None else time.monotonic() + within_s
        while not done.wait(liveness.period_s):
            liveness.check(what)
            if within_s is not None:
                if time.monotonic() > deadline:  # type: ignore[operator]
                    raise PeerLostError(
                        f"{self.conn.name}: {len(works) - arrived[0]} of {len(works)} attention ranks sent no next "
                        f"work item on stage {stage} within {within_s:g}s in a step (afd.timeout_s plus two "
                        "heartbeat limits)"
                    )
            elif deadline is None and arrived[0]:
                deadline = time.monotonic() + self.timeout_s  # a step began: the other peers follow promptly
            elif deadline is not None and time.monotonic() > deadline:
                raise PeerLostError(
                    f"{self.conn.name}: {arrived[0]} of {len(works)} attention ranks started a step on stage "
                    f"{stage} and the others sent nothing within afd.timeout_s={self.timeout_s:g}s"
                )
        if failed:
            raise failed[0]

    def _posted(self, post: Any, tensors: list[torch.Tensor], peer: int, tag: int, attention: int) -> Any:
        """``post(tensors, peer, tag)`` (a process group's ``send`` or ``recv``; ``peer`` is attention rank
        ``attention``'s index in that group); a closed peer is ``PeerLostError``."""
        try:
            return post(tensors, peer, tag)
        except RuntimeError as exc:
            raise PeerLostError(f"{self.conn.name}: attention rank {attention} is gone: {exc}") from exc

    def _post_header(self, stage: int, attention: int) -> tuple[Any, torch.Tensor]:
        """Post the receive of ``attention``'s next header on ``stage`` (two buffers alternate per peer)."""
        flip = self._flip[(stage, attention)] = not self._flip.get((stage, attention), False)
        buf = self._bufs.get(("hdr", stage, attention, flip), self._header_len, (), torch.int64, self.device)
        pg, peer = self._peer(stage, attention)
        return self._posted(pg.recv, [buf], peer, _TAG_HEADER, attention), buf

    def send_work_item_output(self, item: FFNWorkItem, output: torch.Tensor) -> None:
        state = item.state
        if not isinstance(state, _ItemState):
            raise ConnectorError(f"{self.conn.name}: work item was not produced by this connector")
        if output.dtype != self.dtype:
            raise ConnectorError(f"work item output dtype {output.dtype}; expected {self.dtype}")
        out = output.contiguous()
        if state.to_peer_order is not None:
            out = out.index_select(0, state.to_peer_order)
        works, off = [], 0
        for a, rows in enumerate(item.peer_tokens):
            if rows:
                pg, peer = self._peer(item.stage_idx, a)
                works.append(self._posted(pg.send, [out[off : off + rows]], peer, _TAG_OUT, a))
            off += rows
        # completed by the next recv_work_item of this stage (or close); keeps `out` alive
        self._inflight[item.stage_idx] = (works, [out])
