"""Gate on Attention inside vLLM: the routed experts leave vLLM's ``FusedMoE`` at its own seam.

vLLM 0.32's ``FusedMoE`` is a ``MoERunner``: it applies the gate, selects
experts with its router (``router.select_experts``: softmax or grouped
sigmoid top-k, correction bias, renormalisation — exactly vLLM's routing),
runs the shared experts, and calls ``routed_experts.forward_modular(x,
topk_weights, topk_ids, ...)`` for the weighted routed sum. That last call is
the cut:

* **Attention role** — :func:`place_remote_routed_experts` gives each MoE
  layer's ``RoutedExperts`` a :class:`RemoteQuantMethod` whose ``apply``
  dispatches ``(x, topk_ids, topk_weights)`` through the shared
  :class:`~afd_sdk.proxy.RemoteExperts` proxy and returns the combined routed
  output, and drops the routed experts' tensors; gate, router, shared experts
  and the block's sums stay native.
* **FFN role** — :class:`LocalExperts` is a ``FusedMoE`` holding one FFN
  rank's block of experts (top-1, weight 1, the expert id carried in the
  router logits), which is what :class:`~afd_sdk.proxy.RoutedExperts` calls
  for rows grouped by local expert.
"""

from __future__ import annotations

from typing import Any

import torch

from afd_sdk.metadata import MetadataProvider
from afd_sdk.proxy import RemoteExperts

__all__ = [
    "LocalExperts",
    "RemoteQuantMethod",
    "fused_local_experts",
    "place_remote_routed_experts",
    "route_by_expert_id",
]

#: what vLLM's ``MoERunner`` reads of its routed experts' quant method (kept from the native one), with defaults
_RUNNER_READS = {
    "topk_indices_dtype": None,
    "skip_forward_padding": False,
    "has_unpadded_output": False,
    "mk_can_overlap_shared_experts": False,
}


class RemoteQuantMethod(torch.nn.Module):
    """The Attention role's stand-in for a ``RoutedExperts``' quant method: ``apply`` runs the experts remotely.

    Parameter-free. vLLM's runner calls ``apply(layer=..., x=..., topk_weights=...,
    topk_ids=..., ...)`` after its own router selected the experts; the
    connector dispatches the rows and combines the weighted expert outputs.
    """

    is_monolithic = False
    moe_kernel = None
    #: the connector dispatches and combines (vLLM's "internal modular kernel"): a runner in a DP group must not
    #: all-gather the ranks' tokens before it and reduce-scatter after (``MoERunner.do_naive_dispatch_combine``).
    #: Each attention rank sends only its own tokens to the FFN ranks; gathered, every rank would have the
    #: experts compute the whole group's tokens and the reduce-scatter would sum dp_size copies of each output
    #: (and vLLM's CPU communicator implements neither collective: ``NotImplementedError`` in ``all_gatherv``)
    supports_internal_mk = True

    def __init__(self, layer_idx: int, provider: MetadataProvider, native: Any) -> None:
        super().__init__()
        self.remote = RemoteExperts(layer_idx, provider)
        for attr, default in _RUNNER_READS.items():
            setattr(self, attr, getattr(native, attr, default))

    def apply(
        self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, **_: Any
    ) -> torch.Tensor:
        return self.remote(x, topk_ids, topk_weights)

    def process_weights_after_loading(self, layer: Any) -> None:
        """Nothing to prepare: the weights are on the FFN ranks."""


def place_remote_routed_experts(
    layers: Any, ffn_attr: str, moe_layers: tuple[int, ...], provider: MetadataProvider
) -> None:
    """Attention role, gate on Attention: each MoE layer's routed experts run remotely.

    ``layers[i].<ffn_attr>.experts`` is vLLM's ``MoERunner``; its
    ``routed_experts`` keeps its place (the runner reads its configuration)
    but gets a :class:`RemoteQuantMethod` and loses its expert tensors.
    Called once by the alias constructor after vLLM built the native model.
    """
    for i in moe_layers:
        routed = getattr(layers[i], ffn_attr).experts.routed_experts
        routed.quant_method = RemoteQuantMethod(i, provider, routed.quant_method)
        routed._parameters.clear()  # the expert tensors live on the FFN ranks
        routed._ensure_moe_quant_config_init = _nothing


def _nothing() -> None:
    """The runner prepares the native kernel's quant config each forward; the remote path has none."""


def route_by_expert_id(
    hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM custom routing for :class:`LocalExperts`: the logits carry each row's local expert id; weight 1."""
    return torch.ones_like(gating_output, dtype=torch.float32), gating_output.to(torch.int32)


def fused_local_experts(vllm_config: Any, layer_idx: int, prefix: str, num_local: int) -> torch.nn.Module:
    """One FFN rank's block of ``num_local`` routed experts of one layer, as vLLM's own ``FusedMoE``.

    The ``VllmBinding.build_local_experts`` of any architecture whose routed experts are a standard
    ``FusedMoE`` with ``moe_intermediate_size`` (Qwen3-MoE, DeepSeek-V2/V3, GLM-4.5 …): routing, its
    correction bias and scaling and the shared experts stay in the native block on Attention, so each row
    goes to the one local expert the Attention side chose (:func:`route_by_expert_id`, weight 1).
    """
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    cfg = vllm_config.model_config.hf_text_config
    return FusedMoEFactory(
        num_experts=num_local,
        top_k=1,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_intermediate_size,
        renormalize=False,
        quant_config=vllm_config.quant_config,
        prefix=prefix,
        custom_routing_function=route_by_expert_id,
    )


class LocalExperts(torch.nn.Module):
    """One FFN rank's routed experts of one layer, as a vLLM ``FusedMoE`` (``experts``): unweighted outputs.

    Called as the native experts module is in :class:`~afd_sdk.proxy.RoutedExperts`:
    ``(rows, ids[rows, 1], weights[rows, 1])`` with weight 1; each row goes to
    its one local expert, so ``x * 1`` is exact.
    """

    def __init__(self, experts: torch.nn.Module, vllm_config: Any) -> None:
        super().__init__()
        self.experts = experts
        self._vllm_config = vllm_config

    def forward(self, hidden_states: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import set_forward_context

        with set_forward_context(None, self._vllm_config, num_tokens=hidden_states.shape[0]):
            return self.experts(hidden_states=hidden_states, router_logits=ids.to(torch.float32))
