"""``VllmBinding``: how one architecture is cut inside vLLM.

An adapter exposes one through ``bindings["vllm"]`` (a factory taking the
adapter). The Attention role needs nothing from it beyond the attribute path
of the FFN modules: the native model is built and the shared proxies of
:mod:`afd_sdk.proxy` replace its FFN modules. The FFN role needs to know how
vLLM builds *one layer's* FFN module — native ``FusedMoE`` block with its
gate and shared experts, or dense MLP — so that it constructs nothing of
attention or the KV cache, and which native model class's ``load_weights``
maps checkpoint names onto those modules (stacked ``gate_up_proj``, expert
mappings): the FFN role reuses it on a model that holds only FFN modules.

This module imports neither vLLM nor the model; the factories do, when called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from afd_sdk.ffn_output import FFNOutput

__all__ = ["FFNOnlyLayer", "VllmBinding"]

#: ``(vllm_config, layer_idx, prefix) -> module``: vLLM's own FFN module of one decoder layer
FFNFactory = Callable[[Any, int, str], torch.nn.Module]
#: ``(vllm_config, layer_idx, prefix, num_local) -> FusedMoE``: one FFN rank's routed experts of one layer, top-1,
#: routed by :func:`~afd_sdk.integrations.vllm.routed.route_by_expert_id` (gate on Attention)
LocalExpertsFactory = Callable[[Any, int, str, int], torch.nn.Module]


@dataclass(frozen=True)
class VllmBinding:
    """How one architecture maps onto vLLM's native model classes.

    ``inner_class`` (``"module:Class"``) is the native decoder stack whose
    ``load_weights`` the FFN role reuses (e.g. ``Qwen3MoeModel``); it reads the
    attributes ``inner_attrs(vllm_config, layers)`` returns (those its
    ``__init__`` would have set and its loader reads; ``layers`` are the
    FFN-only layers already built). ``build_ffn`` constructs one layer's
    FFN module exactly as the native decoder layer does, with the native
    ``prefix`` (``"model.layers.3.mlp"``) so vLLM's layer registry and the
    checkpoint names line up. ``tiny_overrides`` is what vLLM's CPU kernels
    need of the adapter's tiny config (supported head sizes, MLA ranks,
    routing method) for seeded test checkpoints, ``cpu_dtype`` the dtype
    they need.
    """

    inner_class: str
    build_ffn: FFNFactory
    inner_attrs: Callable[[Any, torch.nn.ModuleList], Mapping[str, Any]] = lambda vllm_config, layers: {}
    inner_attr: str = "model"
    layers_attr: str = "layers"
    ffn_attr: str = "mlp"
    tiny_overrides: Mapping[str, Any] = field(default_factory=dict)
    #: the dtype vLLM's CPU kernels need for this architecture (Qwen3-Next's linear attention: bfloat16)
    cpu_dtype: str = "float32"
    #: gate on Attention (routed dispatch) in vLLM; ``None``: not offered for this architecture
    build_local_experts: LocalExpertsFactory | None = None
    #: how vLLM's FFN module's output maps to the wire and back; ``None``: the adapter's ``ffn_output``.
    #: Set it only when vLLM's module returns something else than the transformers module the adapter describes.
    ffn_output: FFNOutput | None = None
    #: ``"module:Class"`` of every FFN module class the native decoder layers build (MoE block, dense MLP): the
    #: Attention role builds them on the meta device, so the tensors the cut replaces are never allocated
    #: (:func:`~afd_sdk.integrations.vllm.release.construct_on_meta`). Empty: built for real, then freed.
    #: Not used with the gate on Attention, whose FFN modules keep their gate and shared experts there.
    ffn_classes: tuple[str, ...] = ()

    @property
    def layers_path(self) -> str:
        """Dotted path of the decoder layers on the top-level model (``"model.layers"``)."""
        return f"{self.inner_attr}.{self.layers_attr}"

    def ffn_prefix(self, layer_idx: int, root_prefix: str = "") -> str:
        """vLLM's module prefix of layer ``layer_idx``'s FFN module (``"model.layers.3.mlp"``)."""
        base = f"{root_prefix}." if root_prefix else ""
        return f"{base}{self.layers_path}.{layer_idx}.{self.ffn_attr}"


class FFNOnlyLayer(torch.nn.Module):
    """A decoder layer of the FFN role: holds the FFN module under its native attribute, nothing else."""

    def __init__(self, ffn_attr: str, ffn: torch.nn.Module) -> None:
        super().__init__()
        self.ffn_attr = ffn_attr
        setattr(self, ffn_attr, ffn)

    def block(self) -> torch.nn.Module:
        return getattr(self, self.ffn_attr)
