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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from afd_connectors.cam_rendezvous import open_store
from afd_connectors.frames import DeviceBuffers
from afd_connectors.process_groups import shutdown_groups, stage_groups, wait_works
from afd_sdk.connector import FFNWorkItem
from afd_sdk.errors import ConnectorError, PeerLostError, WireFormatError

if TYPE_CHECKING:
    from afd_connectors.cam_connector import CAMAsyncAFDConnector

__all__ = ["PortableCamBackend"]

logger = logging.getLogger(__name__)

DATA, GOODBYE = 0, 1
_TAG_HEADER, _TAG_ROWS, _TAG_OUT = 0, 1, 2
_HEADER_FIELDS = 3  # kind, layer, rows


@dataclass
class _Dispatch:
    """Attention side: one dispatch awaiting its combine."""

    order: torch.Tensor  # sorted row i came from flat (token * top_k + slot) index order[i]
    rows_per_ffn: list[int]
    works: list[Any]
    keep: list[torch.Tensor]


@dataclass
class _ItemState:
    """FFN side: how to send an item's output back."""

    to_peer_order: torch.Tensor | None  # expert-grouped row i goes to peer-order row to_peer_order[i]


class PortableCamBackend:
    """torch.distributed implementation of the CAM dispatch/combine semantics."""

    def __init__(self, conn: CAMAsyncAFDConnector) -> None:
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
        self._dispatches: dict[int, list[_Dispatch]] = {}
        self._inflight: dict[int, tuple[list[Any], list[torch.Tensor]]] = {}
        self._gone: set[int] = set()
        blocks = self.world.expert_blocks
        self._blocks = blocks
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
            self._store, f"afd-cam/{cfg.port}", rank, size, self.dist_backend, cfg.timeout_s, cfg.num_stages
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
        self._dispatches.clear()

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
    ) -> None:
        pg = self._groups[stage]
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat, minlength=self.world.num_experts).tolist()
        rows = hidden.index_select(0, order // k) if order.numel() else hidden[:0]
        works, keep, rows_per_ffn = [], [rows], []
        off = 0
        for f, (start, stop) in enumerate(self._blocks):
            counts = per_expert[start:stop]
            total = sum(counts)
            header = torch.tensor([DATA, layer, total, *counts], dtype=torch.int64, device=self.device)
            keep.append(header)
            works.append(pg.send([header], self.num_attention + f, _TAG_HEADER))
            if total:
                works.append(pg.send([rows[off : off + total]], self.num_attention + f, _TAG_ROWS))
            rows_per_ffn.append(total)
            off += total
        self._dispatches.setdefault(stage, []).append(_Dispatch(order, rows_per_ffn, works, keep))

    def combine(
        self, ref_tensor: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int, stage: int
    ) -> torch.Tensor:
        d = self._dispatches[stage].pop(0)
        pg = self._groups[stage]
        n, k = topk_ids.shape
        ysorted = self._bufs.get(("y", stage), n * k, (self.hidden,), ref_tensor.dtype, ref_tensor.device)
        recvs, off = [], 0
        for f, rows in enumerate(d.rows_per_ffn):
            if rows:
                recvs.append(pg.recv([ysorted[off : off + rows]], self.num_attention + f, _TAG_OUT))
            off += rows
        self._wait(d.works, f"dispatch of layer {layer}, stage {stage}")
        self._wait(recvs, f"expert outputs of layer {layer}, stage {stage}")
        y = torch.empty_like(ysorted)
        y.index_copy_(0, d.order, ysorted)
        # as the native experts module does: weight each expert output, cast, then sum over the top-k
        weighted = (y.view(n, k, self.hidden) * topk_weights.unsqueeze(-1)).to(ref_tensor.dtype)
        return weighted.sum(dim=1)

    # --- ffn side ------------------------------------------------------------------------------

    def recv_work_item(self, stage: int) -> FFNWorkItem | None:
        pg = self._groups[stage]
        works, keep = self._inflight.pop(stage, ([], []))
        self._wait(works, f"expert outputs of the previous work item, stage {stage}")
        del keep
        live = [a for a in range(self.num_attention) if a not in self._gone]
        if not live:
            return None
        headers = {a: self._bufs.get(("hdr", stage, a), self._header_len, (), torch.int64, self.device) for a in live}
        self._wait([pg.recv([headers[a]], a, _TAG_HEADER) for a in live], f"next work item of stage {stage}")
        layer: int | None = None
        counts: dict[int, list[int]] = {}
        for a in live:
            kind, a_layer, total, *per_expert = headers[a].tolist()
            if kind == GOODBYE:
                self._gone.add(a)
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
            to_peer = torch.cat(pieces).to(self.device)
            hidden = recv.index_select(0, to_peer)
        return FFNWorkItem(
            layer_idx=layer,
            stage_idx=stage,
            hidden_states=hidden,
            group_list=torch.tensor(group, dtype=torch.int64),
            expert_start=self._local.start,
            peer_tokens=tuple(peer_rows),
            state=_ItemState(to_peer),
        )

    def send_work_item_output(self, item: FFNWorkItem, output: torch.Tensor) -> None:
        state = item.state
        if not isinstance(state, _ItemState):
            raise ConnectorError(f"{self.conn.name}: work item was not produced by this connector")
        if output.dtype != self.dtype:
            raise ConnectorError(f"work item output dtype {output.dtype}; expected {self.dtype}")
        out = output.contiguous()
        if state.to_peer_order is not None:
            peer_major = torch.empty_like(out)
            peer_major.index_copy_(0, state.to_peer_order, out)
            out = peer_major
        pg = self._groups[item.stage_idx]
        works, off = [], 0
        for a, rows in enumerate(item.peer_tokens):
            if rows:
                works.append(pg.send([out[off : off + rows]], a, _TAG_OUT))
            off += rows
        # completed by the next recv_work_item of this stage (or close); keeps `out` alive
        self._inflight[item.stage_idx] = (works, [out])
