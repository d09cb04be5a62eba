"""The routed-dispatch contract: tokens go to the FFN ranks owning their experts (CAM style).

A sibling of :class:`afd_sdk.connector.AFDConnector`, sharing its lifecycle
base :class:`~afd_sdk.connector.ConnectorBase`. The Attention side runs the
router gate (``compute_gate_on_attention``) and, per MoE layer and stage,
dispatches each token's hidden state to its ``top_k`` experts and combines
the weighted expert outputs. The FFN side is served by work items
(:class:`FFNWorkItem`) through the runtime's
:class:`~afd_sdk.runtime.expert_server.ExpertServer`. Routing and token counts
travel in-band, so there is no control plane.

A connector of this contract declares ``capabilities.async_dispatch=True``
and an attention-first world; model adapters and the runtime decide by that
capability, never by a connector's name.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from afd_sdk.adapter import MoELayout
from afd_sdk.connector import ConnectorBase, ConnectorCapabilities, ConnectorContext
from afd_sdk.errors import AFDConfigError
from afd_sdk.wire import TransferMetadata

if TYPE_CHECKING:
    import torch

__all__ = ["AsyncDispatchConnector", "FFNWorkItem"]


@dataclass
class FFNWorkItem:
    """One layer's routed tokens for one FFN rank, as received by an async-dispatch connector.

    ``hidden_states`` is ``[num_tokens, hidden]``: one row per (token, routed
    expert) pair whose expert lives on this rank, grouped by local expert —
    ``group_list[e]`` rows for local expert ``e`` (global id
    ``expert_start + e``), in order. ``peer_tokens[a]`` counts the rows that
    came from attention rank ``a`` (0 for a rank that sent none or has left).
    ``num_tokens`` may be 0: the exchange still completes, with an empty output.
    ``state`` is the connector's private transfer state; the caller passes the
    item back unchanged to ``send_ffn_work_item_output``.
    """

    layer_idx: int
    stage_idx: int
    hidden_states: torch.Tensor
    group_list: torch.Tensor
    expert_start: int
    peer_tokens: tuple[int, ...]
    state: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.hidden_states.shape[0])


class AsyncDispatchConnector(ConnectorBase):
    """Base of connectors that dispatch routed experts instead of whole hidden states.

    Implement :meth:`open`, :meth:`release` and the four methods below; the
    base owns ``init``/``close``. The constructor requires the model's
    :class:`~afd_sdk.adapter.MoELayout` in the context.
    """

    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities(
        world_layout="attention_first", attention_lt_ffn=True, async_dispatch=True, supports_extras=False
    )

    def __init__(self, context: ConnectorContext) -> None:
        if context.moe is None:
            raise AFDConfigError(
                f"ConnectorContext.moe=None, but {self.display_name} dispatches by expert and needs "
                "the model's MoELayout; expected the adapter's moe_layout() (a dense model cannot use it)",
                key="moe",
                value=None,
            )
        self.moe: MoELayout = context.moe
        super().__init__(context)

    @abc.abstractmethod
    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Attention: dispatch one MoE layer's tokens to the FFN ranks owning their experts.

        Called by the routed-experts proxy once per MoE layer and stage, in
        layer order. ``topk_ids`` (int64, ``[n, top_k]``, global expert ids)
        and ``topk_weights`` (``[n, top_k]``) are required; the dispatch is
        queued FIFO per stage for :meth:`recv_ffn_output`. ``n`` may be 0.
        """

    @abc.abstractmethod
    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        """Attention: combine the oldest pending dispatch of ``stage_idx``.

        Returns ``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x_t)`` as
        a tensor with ``ref_tensor``'s shape, dtype and device. Raises
        ``PeerLostError`` after ``timeout_s``.
        """

    @abc.abstractmethod
    def recv_ffn_work_item(self, stage_idx: int = 0) -> FFNWorkItem | None:
        """FFN: receive the next MoE layer's routed tokens of ``stage_idx`` from every attention rank.

        Called by the expert server in a fixed round-robin over stages.
        Returns ``None`` once every attention rank has said goodbye (orderly
        end). Between steps (the next item is a step's first MoE layer on
        this stage) it waits as long as every attention peer is alive: a
        serving engine idles while it has no requests, and an idle server is
        not an error (:meth:`~afd_sdk.connector.ControlPlane.recv`'s rule). It
        raises ``PeerLostError`` when a peer died, froze or was cut off (within
        ``timeout_s``) and, within a step, when nothing came within ``timeout_s``.
        """

    @abc.abstractmethod
    def send_ffn_work_item_output(self, item: FFNWorkItem, output: torch.Tensor) -> None:
        """FFN: return the unweighted expert outputs of ``item``, row for row.

        ``output`` is ``[item.num_tokens, hidden]`` (``[0, hidden]`` for an
        empty item); the Attention side applies the top-k weights. The send
        may still be in flight on return; the caller does not modify
        ``output`` afterwards.
        """
