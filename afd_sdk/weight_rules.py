"""Which role loads each checkpoint tensor: the rule engine behind ``ModelAdapter.weight_role``.

:class:`LayerRules` classifies one checkpoint name at the FFN boundary. A model
adapter gets one for free, derived from its declared cut
(:meth:`LayerRules.from_cut`: the decoder layers' path, each layer's FFN
attribute, the config's MoE keys and transformers' checkpoint renames); the
hand-written form (the constructor) is for checkpoints whose names follow no
single module path (the bundled DeepSeek-V4 rules keep ``tid2eid`` with the
experts and the shared experts on the FFN side).

Names are classified without loading a tensor and without importing a
framework, except :func:`checkpoint_renames`, which reads transformers'
rename table once per model type when transformers is installed.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LAYER_ATTENTION",
    "LayerRules",
    "WeightRole",
    "checkpoint_renames",
    "moe_layer_rule",
    "normalise",
    "routed_experts",
]


class WeightRole(str, enum.Enum):
    """Which role loads a checkpoint tensor."""

    ATTENTION = "attention"
    FFN = "ffn"
    BOTH = "both"
    NONE = "none"  # skipped by both roles (MTP layers, vision towers)

    def loaded_by(self, role: str) -> bool:
        """True when a worker of ``role`` (``attention``/``ffn``) loads such a tensor."""
        return self is WeightRole.BOTH or self.value == role


#: wrapper prefixes stripped before matching (multimodal wrappers put the text model under ``language_model``)
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
#: top-level parts neither role serves as a text model: vision/audio towers, projectors, MTP heads
_NON_TEXT = ("vision", "visual", "aligner", "image_", "mtp", "audio", "multi_modal_projector")
#: top-level parts the Attention role runs: embeddings, final norm, LM head (V4 native names included)
_TOP_ATTENTION = ("embed_tokens.", "embed.", "lm_head.", "head.", "norm.", "hc_head", "engram")
#: per-layer parts that run on the Attention side (V4 names included: ffn_norm and hc_* are outside the FFN block)
LAYER_ATTENTION = (
    "self_attn.",
    "attn.",
    "linear_attn.",
    "input_layernorm.",
    "post_attention_layernorm.",
    "attn_norm.",
    "ffn_norm.",
    "hc_attn_",
    "hc_ffn_",
    "attn_hc.",
    "ffn_hc.",
    "engram",
)
#: router module names inside an FFN block (``mlp.gate``: Qwen, DeepSeek, Mixtral; ``mlp.router``: gpt-oss)
ROUTER_ATTRS = ("gate", "router")
#: shared-expert module names inside an FFN block (they move to Attention with the gate)
SHARED_ATTRS = ("shared_expert", "shared_experts", "shared_expert_gate")
#: config keys that count routed experts / name the top-k, in the order they are read
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
TOP_K_KEYS = ("num_experts_per_tok",)


def normalise(name: str) -> str:
    """Strip the wrapper prefixes (``model.``, ``model.language_model.`` …) from a name."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def routed_experts(text_config: Mapping[str, Any]) -> int:
    """The routed-expert count a (text) config declares under its first set :data:`EXPERT_COUNT_KEYS` key; 0 if none."""
    return next((int(text_config[k]) for k in EXPERT_COUNT_KEYS if text_config.get(k)), 0)


def moe_layer_rule(text_config: Mapping[str, Any]) -> Callable[[int], bool]:
    """``is_moe_layer(i)`` from a (text) config's standard keys.

    Reads ``mlp_layer_types`` (``"dense"`` marks a dense layer) when present;
    otherwise a layer routes when the config counts experts
    (``num_experts`` / ``n_routed_experts`` / ``num_local_experts`` > 0) and
    no key makes it dense: ``mlp_only_layers`` and ``decoder_sparse_step``
    (Qwen), ``first_k_dense_replace`` and ``moe_layer_freq`` (DeepSeek, GLM).
    """
    types = text_config.get("mlp_layer_types")
    if isinstance(types, list):
        return lambda i: i < len(types) and types[i] != "dense"
    experts = routed_experts(text_config)
    mlp_only = frozenset(int(i) for i in text_config.get("mlp_only_layers") or ())
    step = int(text_config.get("decoder_sparse_step") or 1)
    first_dense = int(text_config.get("first_k_dense_replace") or 0)
    freq = int(text_config.get("moe_layer_freq") or 1)
    return lambda i: experts > 0 and i not in mlp_only and (i + 1) % step == 0 and i >= first_dense and i % freq == 0


@functools.lru_cache(maxsize=64)
def checkpoint_renames(model_type: str) -> tuple[tuple[str, str], ...]:
    """transformers' checkpoint-to-module renames for ``model_type``: ``(pattern, replacement)`` pairs.

    What transformers applies to checkpoint names before loading (e.g.
    Mixtral's ``.block_sparse_moe.`` -> ``.mlp.``, DeepSeek-V4's ``.ffn.`` ->
    ``.mlp.``); the derived rules apply them before matching the cut, so a
    cut declared in module names classifies checkpoint names. Empty when
    transformers is not installed or has no table for ``model_type``.
    Converters that only merge expert tensors (``experts.*.w1`` into
    ``experts.gate_up_proj``) keep names under the FFN block and are not needed.
    """
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return ()
    out: list[tuple[str, str]] = []
    for transform in get_checkpoint_conversion_mapping(model_type) or ():
        if type(transform) is WeightRenaming:
            sources, targets = transform.source_patterns, transform.target_patterns
            out += [(str(s), str(t)) for s, t in zip(sources, targets, strict=False)]
    return tuple(out)


_DEFAULT_LAYER = re.compile(r"layers\.(\d+)\.(.*)")


@dataclass(frozen=True)
class LayerRules:
    """The AFD cut at the FFN boundary, applied to checkpoint tensor names.

    ``is_moe_layer(i)`` says whether decoder layer ``i`` has a routed-expert
    block (else a dense MLP). Per layer, ``ffn_prefixes`` name the FFN block
    (``mlp.``; V4 adds ``ffn.``), ``router_prefixes`` the router inside it,
    ``shared_prefixes`` the shared experts, which move to Attention with the
    gate (the CAM split: FFN ranks hold routed experts only), and
    ``ffn_always`` name endings that stay with the FFN even when the gate
    moves (V4's hash table ``tid2eid``).

    ``layer_attention`` are the per-layer parts that run on Attention
    (``self_attn.``, ``linear_attn.``, the layer norms, … :data:`LAYER_ATTENTION`);
    any other per-layer name stays unclassified, so an unknown tensor is an
    error before anything loads, never a silent default. ``renames``
    (``(regex, replacement)``) turn checkpoint names into module names first;
    ``layer_pattern`` matches ``<layers>.<index>.<rest>`` after the wrapper
    prefixes are stripped. Layers at or past ``num_layers`` (MTP) and
    vision/audio towers belong to neither role.
    """

    num_layers: int
    is_moe_layer: Callable[[int], bool]
    ffn_prefixes: tuple[str, ...] = ("mlp.",)
    router_prefixes: tuple[str, ...] = ("mlp.gate.",)
    shared_prefixes: tuple[str, ...] = ("mlp.shared_expert.", "mlp.shared_experts.", "mlp.shared_expert_gate.")
    ffn_always: tuple[str, ...] = ()
    layer_attention: tuple[str, ...] = LAYER_ATTENTION
    renames: tuple[tuple[str, str], ...] = ()
    layer_pattern: re.Pattern[str] = _DEFAULT_LAYER
    _compiled: tuple[tuple[re.Pattern[str], str], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", tuple((re.compile(p), r) for p, r in self.renames))

    @classmethod
    def from_cut(
        cls,
        text_config: Mapping[str, Any],
        *,
        layers_path: str = "model.layers",
        ffn_attr: str = "mlp",
        router_attrs: tuple[str, ...] = ROUTER_ATTRS,
        shared_attrs: tuple[str, ...] = SHARED_ATTRS,
        attention_parts: tuple[str, ...] = (),
        renames: tuple[tuple[str, str], ...] | None = None,
    ) -> LayerRules:
        """The rules a declared cut implies, for a checkpoint described by ``text_config``.

        ``layers_path`` and ``ffn_attr`` are module names of the native model
        (what the bindings replace); checkpoint names are first renamed with
        ``renames`` (default: :func:`checkpoint_renames` of the config's
        ``model_type``). Per layer, ``attention_parts`` (module names such as
        ``"my_norm"``) run on Attention besides :data:`LAYER_ATTENTION`; MoE
        layers come from :func:`moe_layer_rule`.
        """
        if renames is None:
            renames = checkpoint_renames(str(text_config.get("model_type") or ""))
        layers = normalise(f"{layers_path}.")
        return cls(
            num_layers=int(text_config.get("num_hidden_layers") or 0),
            is_moe_layer=moe_layer_rule(text_config),
            ffn_prefixes=(f"{ffn_attr}.",),
            router_prefixes=tuple(f"{ffn_attr}.{a}." for a in router_attrs),
            shared_prefixes=tuple(f"{ffn_attr}.{a}." for a in shared_attrs),
            layer_attention=LAYER_ATTENTION + tuple(f"{p.rstrip('.')}." for p in attention_parts),
            renames=renames,
            layer_pattern=re.compile(re.escape(layers) + r"(\d+)\.(.*)"),
        )

    def module_name(self, name: str) -> str:
        """``name`` with the renames applied and the wrapper prefixes stripped (what the rules match)."""
        for pattern, replacement in self._compiled:
            name = pattern.sub(replacement, name)
        return normalise(name)

    def role(self, name: str, *, compute_gate_on_attention: bool = False) -> WeightRole | None:
        """The role of checkpoint tensor ``name``; ``None`` when no rule covers it (never a silent default)."""
        n = self.module_name(name)
        if n.startswith(_NON_TEXT):
            return WeightRole.NONE
        m = self.layer_pattern.match(n)
        if m is None:
            return WeightRole.ATTENTION if n.startswith(_TOP_ATTENTION) else None
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= self.num_layers:
            return WeightRole.NONE  # MTP / next-token-prediction layers: neither role serves them
        if rest.startswith(self.ffn_prefixes):
            if not self.is_moe_layer(layer):
                return WeightRole.ATTENTION if compute_gate_on_attention else WeightRole.FFN
            if rest.endswith(self.ffn_always):
                return WeightRole.FFN
            if rest.startswith(self.router_prefixes):
                return WeightRole.BOTH if compute_gate_on_attention else WeightRole.FFN
            if compute_gate_on_attention and rest.startswith(self.shared_prefixes):
                return WeightRole.ATTENTION
            return WeightRole.FFN
        if rest.startswith(self.layer_attention):
            return WeightRole.ATTENTION
        return None
