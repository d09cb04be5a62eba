"""The model cut, shared by every framework binding: proxies on Attention, blocks on FFN.

* :class:`RemoteFFN` replaces a decoder layer's FFN module on the Attention
  role (gate on FFN); :class:`RemoteExperts` replaces a MoE block's routed
  experts (gate on Attention, routed-dispatch connectors).
* :class:`FFNBlocks` and :class:`RoutedExperts` are the FFN role's models:
  the native FFN modules of every layer, or one rank's routed experts.

This module imports torch and nothing of transformers or vLLM: the
transformers binding (:mod:`afd_sdk.integrations.transformers`) and the vLLM
binding (:mod:`afd_sdk.integrations.vllm`) place these same modules into
their framework's model, so a fix to the cut fixes both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from afd_sdk.adapter import ExtraSpec
from afd_sdk.errors import ConnectorError, WireFormatError
from afd_sdk.ffn_output import FFNOutput, TensorOutput, TupleOutput
from afd_sdk.metadata import ForwardMetadata, MetadataProvider
from afd_sdk.wire import TransferMetadata, dtype_from_name

__all__ = [
    "FFNBlocks",
    "FFNOutput",
    "RemoteExperts",
    "RemoteFFN",
    "RoutedExperts",
    "TensorOutput",
    "TupleOutput",
    "module_at",
    "place_remote_experts",
    "place_remote_ffn",
]


def _installed_metadata(provider: MetadataProvider, proxy: str, layer_idx: int) -> ForwardMetadata:
    """The forward metadata a proxy needs; without it an AFD model must not run (it never computes its FFN)."""
    md = provider.current()
    if md is None:
        raise ConnectorError(
            f"the AFD {proxy} proxy of layer {layer_idx} was called with no forward metadata installed; "
            "an AFD model never computes its FFN locally: run it under AttentionRunner or "
            "provider.install(ForwardMetadata(...))"
        )
    return md


class RemoteFFN(torch.nn.Module):
    """Parameter-free stand-in for one decoder layer's FFN module (Attention role).

    Reads the forward metadata through the provider, sends the normalised
    hidden states (plus declared extras) through the metadata's connector and
    returns the FFN output. With no metadata installed it raises: an AFD model
    never falls back to local compute.
    """

    def __init__(
        self,
        layer_idx: int,
        provider: MetadataProvider,
        extras: tuple[ExtraSpec, ...] = (),
        output: FFNOutput | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.provider = provider
        self.extras = extras
        self.output = output or TensorOutput()
        self._extra_dtypes = tuple(dtype_from_name(e.dtype) for e in extras)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        md = _installed_metadata(self.provider, "FFN", self.layer_idx)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if not x.is_contiguous():
            x = x.contiguous()
        extras = None
        if self.extras:
            extras = {}
            for spec, dt in zip(self.extras, self._extra_dtypes, strict=True):
                value = kwargs.get(spec.name)
                if value is None:
                    raise ConnectorError(f"layer {self.layer_idx}: the model did not pass FFN extra {spec.name!r}")
                extras[spec.name] = value.reshape(x.shape[0], *spec.trailing_shape).to(dt)
        conn = md.connector
        conn.send_attn_output(x, TransferMetadata(self.layer_idx, md.stage_idx, (x.shape[0],)), extras=extras)
        y = conn.recv_ffn_output(x, md.stage_idx)
        if y.shape != x.shape or y.dtype != x.dtype:  # never reinterpret: a wrong answer must not reach the model
            raise WireFormatError(
                f"layer {self.layer_idx}, stage {md.stage_idx}: the connector returned {list(y.shape)} {y.dtype} "
                f"for {list(x.shape)} {x.dtype} sent"
            )
        # view_as, not view(shape): torch parses a torch.Size argument at ~5 µs a call, a tensor at under 1 µs
        return self.output.from_wire(y.view_as(hidden_states))

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, remote=True"


class RemoteExperts(torch.nn.Module):
    """Parameter-free stand-in for one MoE layer's routed experts (Attention role, gate on Attention).

    The native MoE block keeps running on Attention — router gate, shared
    experts, output sum — and calls this module where it would call its
    routed experts: ``experts(hidden_states, top_k_index, top_k_weights)``.
    It dispatches through the metadata's async-dispatch connector and returns
    the combined, weighted routed output.
    """

    def __init__(self, layer_idx: int, provider: MetadataProvider) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.provider = provider

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        md = _installed_metadata(self.provider, "routed-experts", self.layer_idx)
        x = hidden_states if hidden_states.is_contiguous() else hidden_states.contiguous()
        conn = md.connector
        conn.send_attn_output(
            x,
            TransferMetadata(self.layer_idx, md.stage_idx, (x.shape[0],)),
            topk_ids=top_k_index,
            topk_weights=top_k_weights,
        )
        return conn.recv_ffn_output(x, md.stage_idx)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, remote=True, dispatch=routed"


class RoutedExperts(torch.nn.Module):
    """The FFN role's model with the gate on Attention: one FFN rank's routed experts per MoE layer.

    ``layers[i]`` is the native experts module of layer ``i`` cut down to this
    rank's experts ``[expert_start, expert_start + num_local)``.
    """

    def __init__(self, layers: Mapping[int, torch.nn.Module], expert_start: int, num_local: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): m for i, m in layers.items()})
        self.expert_start = expert_start
        self.num_local = num_local
        self._local_ids = torch.arange(num_local)

    @torch.no_grad()
    def forward(self, layer_idx: int, hidden_states: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
        """Unweighted expert outputs of ``[rows, hidden]`` rows grouped by local expert (``group_list``)."""
        rows = hidden_states.shape[0]
        if rows == 0:
            return hidden_states.new_empty(hidden_states.shape)
        ids = torch.repeat_interleave(self._local_ids.to(hidden_states.device), group_list.to(hidden_states.device))
        ones = torch.ones(rows, 1, dtype=hidden_states.dtype, device=hidden_states.device)
        # the native experts module with weight 1 and one expert per row: x*1 and 0+x are exact
        return self.layers[str(layer_idx)](hidden_states, ids[:, None], ones)


class FFNBlocks(torch.nn.Module):
    """The FFN role's model: the FFN module of every decoder layer, nothing else."""

    def __init__(
        self, blocks: list[torch.nn.Module], extras: tuple[ExtraSpec, ...] = (), output: FFNOutput | None = None
    ) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.extras = extras
        self.output = output or TensorOutput()

    @torch.no_grad()
    def forward(self, layer_idx: int, hidden_states: torch.Tensor, extras: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """FFN of ``layer_idx`` on ``[tokens, hidden]``; extras are token-aligned."""
        if hidden_states.shape[0] == 0:  # an empty stage: nothing to route
            return torch.empty_like(hidden_states)
        x = hidden_states.unsqueeze(0)  # [1, tokens, hidden]: the native blocks flatten tokens internally
        kwargs = {e.name: extras[e.name].reshape(1, -1, *e.trailing_shape).long() for e in self.extras}
        return self.output.block_result(self.blocks[layer_idx](x, **kwargs), x, layer_idx).squeeze(0)


def module_at(root: Any, path: str) -> Any:
    """``root.<path>`` for a dotted attribute path (``"model.layers"``): where a binding finds the decoder layers."""
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def place_remote_ffn(
    layers: Any,
    ffn_attr: str,
    provider: MetadataProvider,
    extras: tuple[ExtraSpec, ...] = (),
    output: FFNOutput | None = None,
) -> None:
    """Attention role, gate on FFN: replace every decoder layer's FFN module with a :class:`RemoteFFN`.

    Called once by a binding after its framework built the model; ``layers``
    is the model's decoder-layer list, ``ffn_attr`` the FFN module's attribute
    on a layer (``"mlp"``), ``output`` the binding's :class:`FFNOutput`. The
    proxies hold no parameters.
    """
    for i, layer in enumerate(layers):
        setattr(layer, ffn_attr, RemoteFFN(i, provider, extras, output))


def place_remote_experts(
    layers: Any, ffn_attr: str, moe_layers: tuple[int, ...], provider: MetadataProvider, experts_attr: str = "experts"
) -> None:
    """Attention role, gate on Attention: replace each MoE block's routed experts with a :class:`RemoteExperts`.

    The native block keeps its router gate and shared experts; only its
    ``experts_attr`` module leaves. Called once by a binding at start-up.
    """
    for i in moe_layers:
        setattr(getattr(layers[i], ffn_attr), experts_attr, RemoteExperts(i, provider))
