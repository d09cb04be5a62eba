"""The ``ascend`` CAM backend: the CAM operator package on Ascend NPUs.

Calls ``torch.ops.umdk_cam_op_lib.async_dispatch_send / async_dispatch_recv /
async_combine_send / async_combine_recv`` with upstream's argument order over
one HCCL communicator of the Attention-first world
(``torch.distributed.ProcessGroupHCCL`` from torch_npu, on the handshake's
store). torch_npu and the operators are imported only here, only when this
backend is chosen; :func:`ascend_missing` says what is absent without
importing anything heavy twice.

Differences from the portable backend, all imposed by the operators: experts
must split evenly over the FFN ranks; the operators carry no goodbye, so the
FFN side serves until its process is stopped; ``peer_tokens`` of a work item
is the single total (the operators do not expose the per-rank split); and an
FFN rank with no routed tokens returns one zero bf16 row with
``dynamicQuant`` on (the operator cannot take an empty result from a
quantised dispatch) — no token's top-k refers to that rank, so the row never
reaches a result.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

import torch

from afd_connectors.cam.rendezvous import open_store
from afd_sdk.dispatch import FFNWorkItem
from afd_sdk.errors import ConnectorError

if TYPE_CHECKING:
    from afd_connectors.cam.backend import CamHost

__all__ = ["CAM_OPS", "AscendCamBackend", "ascend_missing"]

CAM_OPS = ("async_dispatch_send", "async_dispatch_recv", "async_combine_send", "async_combine_recv")
_COMM_ID = 0


def _cam_ops() -> Any:
    return torch.ops.umdk_cam_op_lib


def ascend_missing() -> str | None:
    """What the ascend backend lacks here, as one phrase; ``None`` when it can run."""
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu (Ascend PyTorch) and the CAM operator package (torch.ops.umdk_cam_op_lib)"
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # a broken CANN install raises anything at import; report it, do not crash
        return f"an importable torch_npu (import failed: {exc!r})"
    try:
        ns = _cam_ops()
        absent = [op for op in CAM_OPS if not hasattr(ns, op)]
    except (AttributeError, RuntimeError) as exc:
        return f"the CAM operator package (torch.ops.umdk_cam_op_lib: {exc})"
    return f"the CAM operators {', '.join(absent)} in torch.ops.umdk_cam_op_lib" if absent else None


class _AscendState:
    """FFN side: the dispatch-recv outputs combine-send needs."""

    def __init__(self, token_nums_rankid_layeridx: torch.Tensor, batch_size: int) -> None:
        self.token_nums_rankid_layeridx = token_nums_rankid_layeridx
        self.batch_size = batch_size


class AscendCamBackend:
    """CAM operator calls; sizes come from the connector, validated before any call."""

    def __init__(self, conn: CamHost) -> None:
        self.conn = conn
        world = conn.world
        self.attn_size = world.num_attention
        self.ffn_size = world.num_ffn
        self.world_size = world.world_size
        self.expert_per_rank = conn.moe.num_experts // world.num_ffn
        self.topk = conn.moe.top_k
        self.hidden = conn.hidden_size
        extra = conn.extra
        self.tp_size = extra.attn_ranks_per_dp
        self.dynamic_quant = extra.dynamicQuant
        self.max_seq_len = conn.context.max_num_tokens
        self.group_name = ""
        self._pg: Any = None
        self._store: Any = None
        self.comm_args: torch.Tensor | None = None
        self._placeholder: torch.Tensor | None = None

    # --- lifecycle -------------------------------------------------------------------

    def _hccl_group(self, store: Any, rank: int) -> tuple[Any, str]:
        """The HCCL communicator of the world and its name (what the operators address)."""
        import torch.distributed as dist

        importlib.import_module("torch_npu")  # registers ProcessGroupHCCL with torch.distributed
        timeout = datetime.timedelta(seconds=self.conn.config.timeout_s)
        prefixed = dist.PrefixStore(f"afd-cam/{self.conn.config.port}/hccl", store)
        pg = dist.ProcessGroupHCCL(prefixed, rank, self.world_size, timeout)  # type: ignore[attr-defined]
        return pg, str(pg.get_hccl_comm_name(rank))

    def init(self) -> None:
        missing = ascend_missing()
        if missing is not None:
            raise ConnectorError(f"{self.conn.name} backend 'ascend' needs {missing}")
        self._store = open_store(self.conn, f"afd-cam/{self.conn.config.port}")
        self._pg, self.group_name = self._hccl_group(self._store, self.conn.world_rank)
        device = self.conn.device
        self.comm_args = torch.empty((1,), dtype=torch.float16, device=device)
        self._placeholder = torch.empty((1,), dtype=torch.bfloat16, device=device)

    def close(self) -> None:
        self._pg = None
        self._store = None
        self.comm_args = None
        self._placeholder = None
        self.group_name = ""

    # --- attention side -------------------------------------------------------------------

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int, stage: int
    ) -> None:  # the operators keep the dispatch state: no handle
        _cam_ops().async_dispatch_send(
            hidden,
            topk_ids,
            self.comm_args,
            _COMM_ID,
            self.max_seq_len,
            hidden.shape[0],
            self.hidden,
            self.topk,
            self.ffn_size,
            self.attn_size,
            self.expert_per_rank,
            self.conn.world_rank,
            self.world_size,
            layer,
            self.tp_size,
            self.dynamic_quant,
            self.group_name,
        )

    def combine(
        self,
        ref_tensor: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layer: int,
        stage: int,
        handle: None,
    ) -> torch.Tensor:
        out = _cam_ops().async_combine_recv(
            ref_tensor.new_empty((1,)),
            topk_ids,
            topk_weights,
            self.comm_args,
            _COMM_ID,
            ref_tensor.shape[0],
            self.hidden,
            self.topk,
            self.ffn_size,
            self.attn_size,
            self.expert_per_rank,
            self.conn.world_rank,
            self.world_size,
            self.group_name,
        )
        return out.view(ref_tensor.shape)

    # --- ffn side --------------------------------------------------------------------------------

    def recv_work_item(self, stage: int) -> FFNWorkItem | None:
        batch = max(1, self.max_seq_len)
        (hidden, _shared, _scales, _shared_scales, token_nums, group_list, _shared_counts) = (
            _cam_ops().async_dispatch_recv(
                self._placeholder,
                self.comm_args,
                _COMM_ID,
                batch,
                self.hidden,
                self.topk,
                self.ffn_size,
                self.attn_size,
                self.expert_per_rank,
                self.conn.world_rank,
                self.world_size,
                self.tp_size,
                self.dynamic_quant,
                self.group_name,
            )
        )
        rows = int(group_list.to(torch.int64).sum())
        layer = int(token_nums[2])
        return FFNWorkItem(
            layer_idx=layer,
            stage_idx=stage,
            hidden_states=hidden[:rows],
            group_list=group_list.to(torch.int64).cpu(),
            expert_start=self.conn.local_experts().start,
            peer_tokens=(rows,),
            state=_AscendState(token_nums, batch),
        )

    def send_work_item_output(self, item: FFNWorkItem, output: torch.Tensor) -> None:
        state = item.state
        if not isinstance(state, _AscendState):
            raise ConnectorError(f"{self.conn.name}: work item was not produced by this connector")
        if item.num_tokens == 0 and self.dynamic_quant:
            # see the module docstring: one zero row no top-k id refers to
            output = torch.zeros((1, self.hidden), dtype=torch.bfloat16, device=output.device)
        _cam_ops().async_combine_send(
            output,
            output,
            self.comm_args,
            state.token_nums_rankid_layeridx,
            _COMM_ID,
            state.batch_size,
            self.hidden,
            self.topk,
            self.ffn_size,
            self.attn_size,
            self.expert_per_rank,
            self.conn.world_rank,
            self.world_size,
            self.tp_size,
            self.group_name,
        )
