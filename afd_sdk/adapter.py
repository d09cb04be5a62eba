"""The model-adapter contract: one architecture family's view of the AFD cut.

An adapter knows where each decoder layer is cut, which checkpoint tensors
each role owns, which per-token extras the FFN side needs, which deployment
features cannot work, and where its framework bindings live. Adapters are
registered per checkpoint architecture name (``Qwen3MoeForCausalLM``) through
the ``afd_register_model_adapters`` hook and ship as separate distributions.
"""

from __future__ import annotations

import abc
import enum
import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

from afd_sdk.errors import AFDConfigError, PluginLoadError, UnclassifiedWeightError, UnsupportedFeatureError

if TYPE_CHECKING:
    import torch

    from afd_sdk.metadata import MetadataProvider

__all__ = [
    "Binding",
    "Deployment",
    "ExtraSpec",
    "MoELayout",
    "ModelAdapter",
    "WeightRole",
    "afd_alias",
    "resolve_target",
]


@dataclass(frozen=True)
class ExtraSpec:
    """One declared per-token extra input the FFN side needs (e.g. ``input_ids``).

    Declared by the model adapter (:meth:`ModelAdapter.ffn_extras`), carried by
    every connector that advertises ``supports_extras``: a model adds payload
    data without editing any connector. ``trailing_shape`` is the shape after
    the token dimension (``()`` for one value per token).
    """

    name: str
    dtype: str
    trailing_shape: tuple[int, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class MoELayout:
    """The routed-expert shape of a model, declared by its adapter (:meth:`ModelAdapter.moe_layout`).

    Connectors that dispatch tokens by expert (``async_dispatch``) size their
    routing from it: ``num_experts`` routed experts, ``top_k`` of them per
    token, on the decoder layers ``moe_layers`` (the others are dense and run
    on Attention when the gate does).
    """

    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]


@runtime_checkable
class Binding(Protocol):
    """How one architecture is cut inside one framework (transformers, vLLM).

    Returned by :meth:`ModelAdapter.binding`; both bindings place the same
    proxies (:mod:`afd_sdk.proxy`) at the cut, so a fix to the cut fixes both.
    """

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
    ) -> tuple[torch.nn.Module, Any]:
        """Build the ``role`` model from ``model_dir`` loading only that role's tensors.

        Called once per worker by the runtime at start-up, after every
        validation passed. Returns ``(model, load_report)``: on Attention the
        native model with proxies at the cut, on FFN the FFN blocks
        (``FFNBlocks``) or, with ``compute_gate_on_attention``, this rank's
        ``experts`` (``RoutedExperts``).
        """
        ...

    def load_native(self, model_dir: str | Path, *, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """The whole unsplit model, the reference a split run is compared with."""
        ...


class WeightRole(str, enum.Enum):
    """Which role loads a checkpoint tensor."""

    ATTENTION = "attention"
    FFN = "ffn"
    BOTH = "both"
    NONE = "none"  # skipped by both roles (MTP layers, vision towers)

    def loaded_by(self, role: str) -> bool:
        """True when a worker of ``role`` (``attention``/``ffn``) loads such a tensor."""
        return self is WeightRole.BOTH or self.value == role


def afd_alias(architecture: str) -> str:
    """The AFD registry alias of an architecture: ``Qwen3MoeForCausalLM`` -> ``AFDQwen3MoeForCausalLM``."""
    return f"AFD{architecture}"


@dataclass(frozen=True)
class Deployment:
    """A typed description of how a model is to be served, for feature validation.

    Built by the runtime or the vLLM integration from their own configs; every
    field has the neutral default so adapters only see what was asked for.
    """

    device: Literal["cpu", "cuda", "npu"] = "cpu"
    #: the connector's canonical name, for messages only: decide by its capabilities below, never by name
    connector: str = "ZmqAFDConnector"
    #: the connector dispatches routed experts (``ConnectorCapabilities.async_dispatch``)
    async_dispatch: bool = False
    compute_gate_on_attention: bool = False
    pipeline_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    sequence_parallel_moe: bool = False
    eplb: bool = False
    speculative_decoding: bool = False
    lora: bool = False
    multimodal: bool = False
    num_stages: int = 1
    moe_backend: str = "auto"
    quantization: str | None = None
    engram: bool = False


def resolve_target(target: str, *, what: str) -> Any:
    """Import ``"package.module:attr"``; failures become ``PluginLoadError`` naming the target."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise PluginLoadError(f"{what} target {target!r} is not of the form 'package.module:attr'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise PluginLoadError(f"{what} target {target!r} cannot be imported: {exc!r}", cause=exc) from exc
    return obj


class ModelAdapter(abc.ABC):
    """Base class of a model-family adapter.

    The plugin manager instantiates one adapter per model with
    ``Adapter(architecture, hf_config)``; ``hf_config`` is the checkpoint's
    ``config.json`` as a mapping (text sub-config already selected for
    multimodal wrappers is the adapter's job). Construction must be cheap and
    import no framework.
    """

    #: Human name shown by ``afd plugins``.
    name: ClassVar[str] = ""
    #: Version of the adapter distribution; part of the handshake fingerprint.
    version: ClassVar[str] = "0"
    #: Checkpoint architecture names this adapter handles.
    architectures: ClassVar[tuple[str, ...]] = ()
    #: architecture -> lazy "module:Class" of its vLLM AFD alias class (registered as ``AFD<arch>``)
    vllm_models: ClassVar[Mapping[str, str]] = {}
    #: backend name ("transformers", "vllm") -> lazy "module:attr" of a factory
    #: called with the adapter instance, returning that backend's binding.
    bindings: ClassVar[Mapping[str, str]] = {}

    def __init__(self, architecture: str, hf_config: Mapping[str, Any]) -> None:
        if architecture not in self.architectures:
            raise AFDConfigError(
                f"architecture={architecture!r} is not handled by adapter {self.name or type(self).__name__}; "
                f"expected one of {', '.join(self.architectures)}",
                key="architecture",
                value=architecture,
            )
        self.architecture = architecture
        self.hf_config = dict(hf_config)

    @property
    def alias(self) -> str:
        """The AFD model name vLLM users select (``AFD<arch>``)."""
        return afd_alias(self.architecture)

    @abc.abstractmethod
    def weight_role(self, name: str, *, compute_gate_on_attention: bool = False) -> WeightRole | None:
        """Classify one checkpoint tensor name without loading it.

        Returns ``None`` when no rule covers ``name`` (never a silent default);
        :meth:`weight_roles` turns those into ``UnclassifiedWeightError``. Pure
        and fast: called for every name of a checkpoint (up to ~10^6).
        """

    def weight_roles(
        self, names: Iterable[str], *, compute_gate_on_attention: bool = False, strict: bool = True
    ) -> dict[str, WeightRole | None]:
        """Classify many names; with ``strict`` any unclassified name raises ``UnclassifiedWeightError``."""
        out = {n: self.weight_role(n, compute_gate_on_attention=compute_gate_on_attention) for n in names}
        if strict:
            missing = [n for n, r in out.items() if r is None]
            if missing:
                raise UnclassifiedWeightError(self.architecture, missing)
        return out

    def ffn_extras(self) -> tuple[ExtraSpec, ...]:
        """Per-token inputs the FFN side needs besides hidden states (default none).

        Called by the runtime at start-up; the Attention proxy sends exactly
        these with every layer, and connectors carry them unchanged.
        """
        return ()

    def moe_layout(self) -> MoELayout | None:
        """Routed experts, top-k and MoE layers of this model; ``None`` for a dense model (default).

        Called by the runtime at start-up when the connector dispatches by
        expert (``capabilities.async_dispatch``); such connectors need it.
        """
        return None

    def validate_deployment(self, deployment: Deployment) -> None:
        """Raise ``UnsupportedFeatureError`` for any feature this architecture cannot serve.

        Called before any resource exists. The default accepts everything.
        """
        return None

    @classmethod
    def tiny_hf_config(cls, architecture: str) -> dict[str, Any] | None:
        """A ``config.json`` mapping (with ``model_type``) of a tiny model of ``architecture``.

        Used by tests and ``afd demo`` to build seeded random checkpoints in
        milliseconds; ``None`` when the architecture has no native transformers
        class. Called rarely; not on any hot path.
        """
        return None

    def binding(self, backend: str) -> Binding:
        """Import the binding factory for ``backend`` lazily and return ``factory(self)``.

        Called by the runtime once per worker at start-up (``"transformers"``)
        and by the vLLM integration (``"vllm"``).
        """
        if backend not in self.bindings:
            raise AFDConfigError(
                f"backend={backend!r} has no binding in adapter {self.name}; "
                f"available: {', '.join(self.bindings) or 'none'}",
                key="backend",
                value=backend,
            )
        factory = resolve_target(self.bindings[backend], what=f"{self.name} {backend} binding")
        return factory(self)

    # --- helpers for feature rules ----------------------------------------

    def reject(self, feature: str, value: object, supported: str) -> UnsupportedFeatureError:
        """Build the standard rejection; ``raise self.reject(...)`` in rules."""
        return UnsupportedFeatureError(self.architecture, feature, value, supported)
