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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from afd_connectors.cam.rendezvous import open_store
from afd_sdk.control import DeviceBuffers, shutdown_groups, stage_groups, wait_works
from afd_sdk.dispatch import FFNWorkItem
from afd_sdk.errors import ConnectorError, PeerLostError, WireFormatError

if TYPE_CHECKING:
    from afd_connectors.cam.backend import CamHost

__all__ = ["PortableCamBackend"]

logger = logging.getLogger(__name__)

DATA, GOODBYE = 0, 1
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
    keep: list[torch.Tensor]


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
        self._groups: list[Any] = []
        self._bufs = DeviceBuffers()
        self._free: dict[int, list[torch.Tensor]] = {}  # stage -> output buffers no dispatch uses
        self._inflight: dict[int, tuple[list[Any], list[torch.Tensor]]] = {}
        self._gone: set[int] = set()
        self._header_recvs: dict[int, dict[int, tuple[Any, torch.Tensor]]] = {}  # stage -> peer -> posted recv
        self._flip: dict[tuple[int, int], bool] = {}
        self._last_layer: dict[int, int] = {}  # stage -> layer of its last work item (none yet: between steps)
        self._step_end = conn.moe.moe_layers[-1] if conn.moe.moe_layers else None
        self._blocks = self.world.expert_blocks
        if conn.role == "ffn":
            self._local = self.world.local_experts(conn.role_rank)
            self._header_len = _HEADER_FIELDS + len(self._local)

    # --- lifecycle -----------------------------------------------------------------

    def init(self) -> None:
        if self.dist_backend == "nccl" and not torch.cuda.is_available():
            raise ConnectorError(f"{self.conn.name}: CUDA tensors need NCCL, and torch.cuda.is_available() is False")
        cfg = self.conn.config
        self._store = open_store(self.conn, f"afd-cam/{cfg.port}")
        rank, size = self.conn.world_rank, self.world.world_size
        self._groups = stage_groups(
            self._store,
            f"afd-cam/{cfg.port}",
            rank,
            size,
            self.dist_backend,
            cfg.timeout_s,
            cfg.num_stages,
            host=cfg.host,
            port=cfg.port,
            interface=cfg.interface,
        )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._gone.clear()

    def close(self) -> None:
        if self._groups and self.conn.role == "attention":
            self._say_goodbye()
        inflight, self._inflight = self._inflight, {}
        for works, _keep in inflight.values():  # the last outputs must reach attention before the groups go
            try:
                self._wait(works, "last expert outputs")
            except PeerLostError as exc:
                logger.debug("%s: last expert outputs not delivered: %s", self.conn.name, exc)
        groups, self._groups = self._groups, []
        shutdown_groups(groups, self.conn.name)
        self._store = None
        self._bufs.clear()
        self._free.clear()
        self._header_recvs.clear()
        self._flip.clear()
        self._last_layer.clear()

    def _say_goodbye(self) -> None:
        """Retire this Attention rank on every FFN rank (stage 0, where each FFN step starts)."""
        pg = self._groups[0]
        works, keep = [], []
        for f, (start, stop) in enumerate(self._blocks):
            header = torch.zeros(_HEADER_FIELDS + stop - start, dtype=torch.int64, device=self.device)
            header[0] = GOODBYE
            keep.append(header)
            try:
                works.append(pg.send([header], self.num_attention + f, _TAG_HEADER))
            except RuntimeError as exc:
                logger.debug("%s: goodbye to ffn rank %d not sent: %s", self.conn.name, f, exc)
        try:
            self._wait(works, "goodbye")
        except PeerLostError as exc:  # the FFN side is gone already: nothing to tell it
            logger.debug("%s: goodbye not delivered: %s", self.conn.name, exc)

    # --- helpers -------------------------------------------------------------------------

    def _wait(self, works: Sequence[Any], what: str) -> None:
        wait_works(works, self.timeout_s, f"{self.conn.name}: {what}")

    # --- attention side ---------------------------------------------------------------------

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int, stage: int
    ) -> _Dispatch:
        pg = self._groups[stage]
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat, minlength=self.world.num_experts).tolist()
        rows = hidden.index_select(0, order // k) if k > 1 else hidden.index_select(0, order)
        buffer = self._output_buffer(stage, rows.shape[0], hidden)
        outputs = buffer[: rows.shape[0]]
        works, recvs, keep = [], [], [rows]
        off = 0
        for f, (start, stop) in enumerate(self._blocks):
            counts = per_expert[start:stop]
            total = sum(counts)
            header = torch.tensor([DATA, layer, total, *counts], dtype=torch.int64, device=self.device)
            keep.append(header)
            peer = self.num_attention + f
            works.append(pg.send([header], peer, _TAG_HEADER))
            if total:
                recvs.append(pg.recv([outputs[off : off + total]], peer, _TAG_OUT))
                works.append(pg.send([rows[off : off + total]], peer, _TAG_ROWS))
            off += total
        return _Dispatch(order, works, recvs, outputs, buffer, keep)

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
        self._wait(d.works, f"dispatch of layer {layer}, stage {stage}")
        self._wait(d.recvs, f"expert outputs of layer {layer}, stage {stage}")
        # back to (token, slot) order with one gather, then as the native experts module does: weight each
        # expert output, cast, sum over the top-k (slot by slot: a reduction kernel is slower for small k)
        y = d.outputs.index_select(0, torch.argsort(d.order)).view(n, k, self.hidden)
        self._free.setdefault(stage, []).append(d.buffer)
        weighted = (y * topk_weights.unsqueeze(-1)).to(ref_tensor.dtype)
        out = weighted[:, 0]
        for slot in range(1, k):
            out = out + weighted[:, slot]
        return out

    # --- ffn side ------------------------------------------------------------------------------

    def recv_work_item(self, stage: int) -> FFNWorkItem | None:
        pg = self._groups[stage]
        works, keep = self._inflight.pop(stage, ([], []))
        self._wait(works, f"expert outputs of the previous work item, stage {stage}")
        del keep
        live = [a for a in range(self.num_attention) if a not in self._gone]
        if not live:
            return None
        posted = self._header_recvs.pop(stage, {})
        headers = {a: posted.get(a) or self._post_header(pg, stage, a) for a in live}
        if self._last_layer.get(stage, self._step_end) == self._step_end:
            self._wait_between_steps([headers[a][0] for a in live], stage)
        else:
            self._wait([headers[a][0] for a in live], f"next work item of stage {stage}")
        layer: int | None = None
        counts: dict[int, list[int]] = {}
        for a in live:
            kind, a_layer, total, *per_expert = headers[a][1].tolist()
            if kind == GOODBYE:
                self._gone.add(a)
                if self.conn.liveness is not None:
                    self.conn.liveness.retire(a)  # attention rank a is world rank a
                continue
            if kind != DATA or total != sum(per_expert) or total < 0:
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
        self._last_layer[stage] = layer
        # the next headers' receives go up now, so the attention side's sends never wait for them
        self._header_recvs[stage] = {a: self._post_header(pg, stage, a) for a in counts}
        peer_rows = [sum(counts.get(a, ())) for a in range(self.num_attention)]
        total = sum(peer_rows)
        recv = self._bufs.get(("rows", stage), total, (self.hidden,), self.dtype, self.device)
        recvs, off = [], 0
        for a, rows in enumerate(peer_rows):
            if rows:
                recvs.append(pg.recv([recv[off : off + rows]], a, _TAG_ROWS))
            off += rows
        self._wait(recvs, f"routed tokens of layer {layer}, stage {stage}")
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

    def _wait_between_steps(self, works: list[Any], stage: int) -> None:
        """Wait for the next step's headers as long as every peer is alive (see the module docstring)."""
        liveness = self.conn.liveness
        if liveness is None:  # not opened through the connector: the plain deadline
            self._wait(works, f"next work item of stage {stage}")
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
        deadline: float | None = None
        while not done.wait(liveness.period_s):
            liveness.check(what)
            if deadline is None and arrived[0]:
                deadline = time.monotonic() + self.timeout_s  # a step began: the other peers follow promptly
            elif deadline is not None and time.monotonic() > deadline:
                raise PeerLostError(
                    f"{self.conn.name}: {arrived[0]} of {len(works)} attention ranks started a step on stage "
                    f"{stage} and the others sent nothing within afd.timeout_s={self.timeout_s:g}s"
                )
        if failed:
            raise failed[0]

    def _post_header(self, pg: Any, stage: int, peer: int) -> tuple[Any, torch.Tensor]:
        """Post the receive of ``peer``'s next header on ``stage`` (two buffers alternate per peer)."""
        flip = self._flip[(stage, peer)] = not self._flip.get((stage, peer), False)
        buf = self._bufs.get(("hdr", stage, peer, flip), self._header_len, (), torch.int64, self.device)
        return pg.recv([buf], peer, _TAG_HEADER), buf

    def send_work_item_output(self, item: FFNWorkItem, output: torch.Tensor) -> None:
        state = item.state
        if not isinstance(state, _ItemState):
            raise ConnectorError(f"{self.conn.name}: work item was not produced by this connector")
        if output.dtype != self.dtype:
            raise ConnectorError(f"work item output dtype {output.dtype}; expected {self.dtype}")
        out = output.contiguous()
        if state.to_peer_order is not None:
            out = out.index_select(0, state.to_peer_order)
        pg = self._groups[item.stage_idx]
        works, off = [], 0
        for a, rows in enumerate(item.peer_tokens):
            if rows:
                works.append(pg.send([out[off : off + rows]], a, _TAG_OUT))
            off += rows
        # completed by the next recv_work_item of this stage (or close); keeps `out` alive
        self._inflight[item.stage_idx] = (works, [out])
