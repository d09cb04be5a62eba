"""The transformers binding: split a native transformers model at the FFN boundary.

* Attention role: the native ``*ForCausalLM`` class, loaded with only the
  Attention-role tensors, with each decoder layer's FFN module replaced by a
  parameter-free :class:`~afd_sdk.proxy.RemoteFFN` proxy.
* FFN role: :class:`~afd_sdk.proxy.FFNBlocks`, only the decoder layers' FFN
  modules, loaded with only the FFN-role tensors.

The proxies and blocks are the shared cut of :mod:`afd_sdk.proxy`; this
module only places them. (The seeded tiny checkpoints that ``afd demo`` and
the tests run are :mod:`afd_sdk.checkpoints`'; re-exported here.)

Loading reads each role's tensors from the safetensors shards itself and
hands them to transformers' own loader (``from_pretrained(state_dict=…)``), so
transformers' checkpoint conversions — fused experts, DeepSeek-V4 native
names, multimodal prefixes — apply unchanged. The result is checked strictly:
no unexpected key, and no missing key inside the part the role keeps.

transformers is imported lazily; ``import afd_sdk`` does not need it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from afd_sdk.adapter import ModelAdapter, MoELayout, WeightRole
from afd_sdk.checkpoints import quiet_transformers, save_tiny_checkpoint
from afd_sdk.errors import AFDConfigError, AFDError
from afd_sdk.metadata import MetadataProvider
from afd_sdk.proxy import (
    FFNBlocks,
    FFNOutput,
    RoutedExperts,
    module_at,
    place_remote_experts,
    place_remote_ffn,
)
from afd_sdk.weight_rules import EXPERT_COUNT_KEYS

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "LoadReport",
    "TransformersBinding",
    "WeightLoadError",
    "default_binding",
    "quiet_transformers",
    "save_tiny_checkpoint",
]


class WeightLoadError(AFDError):
    """A role's filtered load left keys missing or unexpected."""


@dataclass
class LoadReport:
    """What a role load read and what transformers reported."""

    role: str
    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    missing_in_role: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


_PER_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)(\..+)$")


def _local_expert(fh: Any, name: str, block: range, total: int) -> tuple[str, torch.Tensor] | None:
    """``(name, tensor)`` of ``name`` as the rank holding experts ``block`` loads it, or ``None`` to skip it.

    Per-expert tensors (``….experts.7.up_proj.weight``) outside the block are skipped and the rest renumbered
    from 0; fused tensors (``….experts.gate_up_proj``, ``[num_experts, …]``) are read as the block's rows.
    """
    m = _PER_EXPERT.match(name)
    if m is not None:
        e = int(m.group(2))
        return (f"{m.group(1)}{e - block.start}{m.group(3)}", fh.get_tensor(name)) if e in block else None
    if ".experts." in name:
        sl = fh.get_slice(name)
        shape = sl.get_shape()
        if shape and shape[0] == total:
            return name, sl[block.start : block.stop]
    return name, fh.get_tensor(name)


class TransformersBinding:
    """How one architecture maps onto its native transformers class.

    Adapters expose one through ``bindings["transformers"]``, a factory taking
    the adapter; the default factory (:func:`default_binding`) is
    :meth:`for_adapter` with the transformers class named like the
    architecture. ``model_class`` names the transformers class (text-only
    class for multimodal checkpoints, with ``text_config=True``);
    ``layers_path`` is the attribute path of the decoder layers; ``ffn_attr``
    the FFN module of a layer; ``ffn_output`` how that module's output maps to
    the wire and back (``None``: the adapter's ``ffn_output``).
    """

    def __init__(
        self,
        model_class: str,
        *,
        layers_path: str = "model.layers",
        ffn_attr: str = "mlp",
        text_config: bool = False,
        ffn_output: FFNOutput | None = None,
    ) -> None:
        self.model_class_name = model_class
        self.layers_path = layers_path
        self.ffn_attr = ffn_attr
        self.text_config = text_config
        self.ffn_output = ffn_output

    @classmethod
    def for_adapter(
        cls, adapter: ModelAdapter, model_class: str | None = None, *, text_config: bool = False
    ) -> TransformersBinding:
        """The binding of ``adapter``'s declared cut (``layers_path``, ``ffn_attr``, ``ffn_output``) on
        ``model_class`` (default: the transformers class named like the architecture)."""
        return cls(
            model_class or adapter.architecture,
            layers_path=adapter.layers_path,
            ffn_attr=adapter.ffn_attr,
            text_config=text_config,
            ffn_output=adapter.ffn_output,
        )

    # --- pieces ---------------------------------------------------------------

    def model_class(self) -> type[PreTrainedModel]:
        import transformers

        cls = getattr(transformers, self.model_class_name, None)
        if cls is None:
            raise AFDConfigError(
                f"transformers {transformers.__version__} has no class {self.model_class_name}; "
                "upgrade transformers (pip install -U transformers)",
                key="architecture",
                value=self.model_class_name,
            )
        return cls

    def config(self, model_dir: str | Path) -> PretrainedConfig:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
        return cfg.get_text_config() if self.text_config else cfg

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        return module_at(model, self.layers_path)

    def ffn_prefixes(self, num_layers: int) -> tuple[str, ...]:
        return tuple(f"{self.layers_path}.{i}.{self.ffn_attr}." for i in range(num_layers))

    # --- loading -------------------------------------------------------------------

    def load_native(self, model_dir: str | Path, *, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """The whole native model (the reference the split is checked against); ``dtype`` default float32."""
        dtype = dtype or torch.float32
        with quiet_transformers():
            model = self.model_class().from_pretrained(str(model_dir), config=self.config(model_dir), dtype=dtype)
        return model.eval()

    def load_role(
        self,
        adapter: ModelAdapter,
        model_dir: str | Path,
        role: str,
        *,
        provider: MetadataProvider | None = None,
        dtype: torch.dtype | None = None,
        compute_gate_on_attention: bool = False,
        experts: range | None = None,
    ) -> tuple[torch.nn.Module, LoadReport]:
        """Build the ``role`` model from ``model_dir`` loading only that role's tensors.

        With ``compute_gate_on_attention`` (async-dispatch connectors): the
        Attention model keeps each MoE block (gate, shared experts) and dense
        MLPs, with the routed experts replaced by :class:`RemoteExperts`; the
        FFN model is :class:`RoutedExperts` holding the routed ``experts``
        (global ids, default all) of every MoE layer: only those experts'
        tensors are read (per-expert names renumbered from 0, fused
        ``[num_experts, …]`` tensors read as row slices) into a model built
        with that many experts.
        """
        from safetensors import safe_open

        dtype = dtype or torch.float32
        if role not in ("attention", "ffn"):
            raise AFDConfigError(f"role={role!r} is invalid; expected 'attention' or 'ffn'", key="role", value=role)
        if role == "attention" and provider is None:
            raise AFDConfigError("the attention role needs a metadata provider for its FFN proxies", key="provider")
        moe = adapter.moe_layout() if compute_gate_on_attention else None
        if compute_gate_on_attention and moe is None:
            raise adapter.reject("compute_gate_on_attention", True, "False (the model declares no routed experts)")
        block = None
        if moe is not None and role == "ffn":
            block = experts if experts is not None else range(moe.num_experts)
            if block.step != 1 or not 0 <= block.start < block.stop <= moe.num_experts:
                raise AFDConfigError(
                    f"experts={block!r} is not a contiguous non-empty block of the model's {moe.num_experts} experts",
                    key="experts",
                    value=str(block),
                )
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise AFDConfigError(f"{str(model_dir)!r} holds no *.safetensors file", key="model", value=str(model_dir))
        report = LoadReport(role)
        state: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), "pt") as fh:
                names = list(fh.keys())
                roles = adapter.weight_roles(names, compute_gate_on_attention=compute_gate_on_attention)
                for name, r in roles.items():
                    if block is not None:  # routed experts only (the gate stays on Attention), this rank's block
                        local = _local_expert(fh, name, block, moe.num_experts) if r is WeightRole.FFN else None
                        if local is None:
                            report.skipped.append(name)
                        else:
                            state[local[0]] = local[1]
                            report.loaded.append(name)
                    elif r is not None and r.loaded_by(role):
                        state[name] = fh.get_tensor(name)
                        report.loaded.append(name)
                    else:
                        report.skipped.append(name)
        cfg = self.config(model_dir)
        if block is not None:
            for attr in EXPERT_COUNT_KEYS:  # the expert count, set to the rank's block size on an FFN rank
                if getattr(cfg, attr, None) == moe.num_experts:
                    setattr(cfg, attr, len(block))
        with quiet_transformers():
            model, info = self.model_class().from_pretrained(
                None, config=cfg, state_dict=state, output_loading_info=True, dtype=dtype
            )
        del state
        num_layers = len(self.layers(model))
        prefixes = (
            self.ffn_prefixes(num_layers)
            if moe is None
            else tuple(f"{self.layers_path}.{i}.{self.ffn_attr}.experts." for i in moe.moe_layers)
        )
        keep_ffn = role == "ffn"
        report.unexpected = sorted(info["unexpected_keys"])
        report.missing_in_role = sorted(k for k in info["missing_keys"] if k.startswith(prefixes) == keep_ffn)
        if report.unexpected or report.missing_in_role:
            raise WeightLoadError(
                f"{adapter.architecture} {role} load from {str(model_dir)!r}: "
                f"{len(report.missing_in_role)} missing key(s) {report.missing_in_role[:5]}, "
                f"{len(report.unexpected)} unexpected key(s) {report.unexpected[:5]}"
            )
        layers = self.layers(model)
        if moe is not None:
            return self._split_experts(model, layers, role, moe, provider, block), report
        extras = adapter.ffn_extras()
        output = self.ffn_output or adapter.ffn_output
        if role == "ffn":
            blocks = FFNBlocks([getattr(layer, self.ffn_attr) for layer in layers], extras, output).eval()
            del model
            return blocks, report
        assert provider is not None
        place_remote_ffn(layers, self.ffn_attr, provider, extras, output)
        return model.eval(), report

    def _split_experts(
        self,
        model: torch.nn.Module,
        layers: torch.nn.ModuleList,
        role: str,
        moe: MoELayout,
        provider: MetadataProvider | None,
        experts: range | None,
    ) -> torch.nn.Module:
        """The gate-on-Attention split: routed experts leave the MoE blocks."""
        if role == "attention":
            assert provider is not None
            place_remote_experts(layers, self.ffn_attr, moe.moe_layers, provider)
            return model.eval()
        assert experts is not None
        kept = {}
        for i in moe.moe_layers:
            module = getattr(layers[i], self.ffn_attr).experts
            if getattr(module, "num_experts", len(experts)) != len(experts):
                raise WeightLoadError(
                    f"layer {i}: the experts module holds {module.num_experts} experts, expected {len(experts)}; "
                    "the config's expert-count attribute was not recognised"
                )
            kept[i] = module
        del model
        return RoutedExperts(kept, experts.start, len(experts)).eval()


def default_binding(adapter: ModelAdapter) -> TransformersBinding:
    """``ModelAdapter.bindings["transformers"]`` by default: the adapter's cut on the transformers class
    named like its architecture."""
    return TransformersBinding.for_adapter(adapter)
