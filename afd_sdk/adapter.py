"""The model-adapter contract: one architecture family's view of the AFD cut.

An adapter knows where each decoder layer is cut, which checkpoint tensors
each role owns, which per-token extras the FFN side needs, which deployment
features cannot work, and where its framework bindings live. Adapters are
registered per checkpoint architecture name (``Qwen3MoeForCausalLM``) through
the ``afd_register_model_adapters`` hook and ship as separate distributions.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

from afd_sdk.capabilities import ConnectorCapabilities
from afd_sdk.errors import AFDConfigError, PluginLoadError, UnclassifiedWeightError, UnsupportedFeatureError
from afd_sdk.ffn_output import FFNOutput, TensorOutput
from afd_sdk.hookspecs import hookimpl
from afd_sdk.weight_rules import TOP_K_KEYS, LayerRules, WeightRole, routed_experts

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
    "adapter_plugin",
    "afd_alias",
    "register_adapter",
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


def afd_alias(architecture: str) -> str:
    """The AFD registry alias of an architecture: ``Qwen3MoeForCausalLM`` -> ``AFDQwen3MoeForCausalLM``."""
    return f"AFD{architecture}"


@dataclass(frozen=True)
class Deployment:
    """A typed description of how a model is to be served, for feature validation.

    Built by the reference runtime and by the vLLM integration from their own
    configs, and handed to :meth:`ModelAdapter.validate_deployment` before any
    weight loads or socket opens; every field has the neutral default so
    adapters only see what was asked for.
    """

    device: Literal["cpu", "cuda", "npu"] = "cpu"
    #: the connector's canonical name, for messages only: decide by its capabilities below, never by name
    connector: str = "ZmqAFDConnector"
    #: what the connector can do (its class's ``capabilities``): devices, dtypes, extras, routed dispatch
    capabilities: ConnectorCapabilities = field(default_factory=ConnectorCapabilities)
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
    #: the checkpoint's quantization method (``quantization_config.quant_method``; vLLM's ``quantization``)
    quantization: str | None = None
    engram: bool = False

    @property
    def async_dispatch(self) -> bool:
        """The connector dispatches routed experts (``capabilities.async_dispatch``): gate on Attention needs it."""
        return self.capabilities.async_dispatch


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


class ModelAdapter:
    """Base class of a model-family adapter.

    The plugin manager instantiates one adapter per model with
    ``Adapter(architecture, hf_config)``; ``hf_config`` is the checkpoint's
    ``config.json`` as a mapping. Construction must be cheap and import no
    framework.

    What an adapter must say is only what cannot be derived: its
    ``architectures``, where the cut is when it is not the usual
    ``model.layers[i].mlp`` (``layers_path``, ``ffn_attr``), what the FFN
    block returns when it is not one tensor (``ffn_output``), the features it
    cannot serve (:meth:`validate_deployment`) and a tiny config for tests
    (:meth:`tiny_hf_config`). Weight roles (:meth:`layer_rules`), the
    routed-expert layout (:meth:`moe_layout`) and the transformers binding are
    derived from those and the config; override them where they do not fit.
    """

    #: Human name shown by ``afd plugins``.
    name: ClassVar[str] = ""
    #: Version of the adapter distribution; part of the handshake fingerprint.
    version: ClassVar[str] = "0"
    #: Checkpoint architecture names this adapter handles (:func:`register_adapter` registers each).
    architectures: ClassVar[tuple[str, ...]] = ()
    #: the cut, in the native model's module names: the decoder layers, and each layer's FFN block
    layers_path: ClassVar[str] = "model.layers"
    ffn_attr: ClassVar[str] = "mlp"
    #: per-layer modules, besides the usual ones (``self_attn``, ``linear_attn``, the layer norms), that run on
    #: Attention; a per-layer name that matches neither these nor the FFN block stays unclassified (an error)
    attention_parts: ClassVar[tuple[str, ...]] = ()
    #: how the FFN block's output maps to the tensor that crosses the wire and back; one tensor by default,
    #: ``TupleOutput(index=0, arity=2)`` for a block returning ``(hidden_states, router_scores)``. Every binding
    #: (transformers, vLLM) uses this one declaration.
    ffn_output: ClassVar[FFNOutput] = TensorOutput()
    #: architecture -> lazy "module:Class" of its vLLM AFD alias class (registered as ``AFD<arch>``)
    vllm_models: ClassVar[Mapping[str, str]] = {}
    #: backend name ("transformers", "vllm") -> lazy "module:attr" of a factory called with the adapter
    #: instance, returning that backend's binding. The default transformers binding builds the
    #: transformers class named like the architecture, cut at ``layers_path`` / ``ffn_attr``. A subclass's
    #: mapping extends the inherited one (declaring only ``{"vllm": …}`` keeps the transformers binding);
    #: map a backend to ``None`` to drop an inherited binding.
    bindings: ClassVar[Mapping[str, str | None]] = {"transformers": "afd_sdk.integrations.transformers:default_binding"}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("bindings")
        if own is not None:  # extend what the parent binds instead of replacing it (see ``bindings``)
            inherited = super(cls, cls).bindings  # the nearest base's, already merged
            cls.bindings = {k: v for k, v in {**inherited, **own}.items() if v is not None}

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
        self._layer_rules: LayerRules | None = None

    @property
    def alias(self) -> str:
        """The AFD model name vLLM users select (``AFD<arch>``)."""
        return afd_alias(self.architecture)

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's config: ``hf_config["text_config"]`` for multimodal wrappers, else ``hf_config``."""
        text = self.hf_config.get("text_config")
        return dict(text) if isinstance(text, Mapping) else self.hf_config

    def layer_rules(self) -> LayerRules:
        """The weight-role rules of this model (built once, then cached).

        Default: :meth:`LayerRules.from_cut <afd_sdk.weight_rules.LayerRules.from_cut>`
        of ``layers_path`` / ``ffn_attr`` / ``attention_parts`` and
        :attr:`text_config` — the FFN block's tensors are the FFN's (router
        and shared experts move to Attention with the gate); a layer's
        attention, linear attention, norms and ``attention_parts`` are
        Attention's, as are embeddings, the final norm and the LM head;
        vision/audio towers and MTP layers are neither's; anything else is
        unclassified. Checkpoint names are
        renamed with transformers' table for the config's ``model_type`` first
        (Mixtral's ``block_sparse_moe`` is ``mlp``). Override to return
        hand-written :class:`~afd_sdk.weight_rules.LayerRules` when the
        checkpoint's names follow no module path.
        """
        if self._layer_rules is None:
            cut = {"layers_path": self.layers_path, "ffn_attr": self.ffn_attr, "attention_parts": self.attention_parts}
            self._layer_rules = LayerRules.from_cut(self.text_config, **cut)
        return self._layer_rules

    def weight_role(self, name: str, *, compute_gate_on_attention: bool = False) -> WeightRole | None:
        """Classify one checkpoint tensor name without loading it.

        Called by both roles' loaders and ``afd weights classify`` for every
        name of a checkpoint (up to ~10^6): pure and fast. Returns ``None``
        when no rule covers ``name`` (never a silent default);
        :meth:`weight_roles` turns those into ``UnclassifiedWeightError``.
        Default: :meth:`layer_rules`.
        """
        return self.layer_rules().role(name, compute_gate_on_attention=compute_gate_on_attention)

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
        """Routed experts, top-k and MoE layers of this model; ``None`` for a dense model.

        Called by the runtimes at start-up (validation, and connectors that
        dispatch by expert, ``capabilities.async_dispatch``, size their routing
        from it) and by the transformers binding for gate on Attention.
        Default: from :attr:`text_config`'s standard keys — experts from
        ``num_experts`` / ``n_routed_experts`` / ``num_local_experts``, top-k
        from ``num_experts_per_tok``, MoE layers from :meth:`layer_rules`.
        """
        cfg = self.text_config
        experts = routed_experts(cfg)
        if experts <= 0:
            return None
        top_k = next((int(cfg[k]) for k in TOP_K_KEYS if cfg.get(k)), 1)
        rules = self.layer_rules()
        return MoELayout(experts, top_k, tuple(i for i in range(rules.num_layers) if rules.is_moe_layer(i)))

    def validate_deployment(self, deployment: Deployment) -> None:
        """Raise ``UnsupportedFeatureError`` (:meth:`reject`) for any feature this architecture cannot serve.

        Called by the reference runtime and by the vLLM integration once per
        worker, after the config parsed and before any weight loads or socket
        opens. Decide by ``deployment.capabilities``, never by the connector's
        name. The default accepts everything.
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

        Raises ``AFDConfigError`` naming the available backends when the
        adapter has no binding for ``backend``.

        Called by the runtime once per worker at start-up (``"transformers"``)
        and by the vLLM integration (``"vllm"``).
        """
        if self.bindings.get(backend) is None:
            raise AFDConfigError(
                f"backend={backend!r} has no binding in adapter {self.name}; "
                f"available: {', '.join(self.bindings) or 'none'}",
                key="backend",
                value=backend,
            )
        factory = resolve_target(self.bindings[backend], what=f"{self.name} {backend} binding")
        return factory(self)

    # --- helpers for feature rules ----------------------------------------

    def require_routed_dispatch(self, d: Deployment) -> None:
        """Reject gate on Attention over a connector that cannot carry routed work items.

        With ``compute_gate_on_attention`` the router runs on Attention and the routed experts' rows cross the
        cut as work items, which only a connector with ``capabilities.async_dispatch`` carries (e.g.
        ``CAMAsyncAFDConnector``). Call it first thing in :meth:`validate_deployment` of an adapter that offers
        gate on Attention; decided by capability, never by the connector's name.
        """
        if d.compute_gate_on_attention and not d.async_dispatch:
            raise self.reject(
                "connector",
                d.connector,
                "a routed-dispatch connector (capabilities.async_dispatch=True, e.g. 'CAMAsyncAFDConnector') when "
                "compute_gate_on_attention=True",
            )

    def reject(self, feature: str, value: object, supported: str) -> UnsupportedFeatureError:
        """Build the standard rejection; ``raise self.reject(...)`` in rules."""
        return UnsupportedFeatureError(self.architecture, feature, value, supported)


def adapter_plugin(*adapters: type[ModelAdapter] | str) -> Callable[..., None]:
    """The ``afd_register_model_adapters`` hook of an adapter package, registering ``adapters``.

    An adapter distribution's whole entry-point module is then one line::

        afd_register_model_adapters = adapter_plugin("my_pkg.adapter:MyAdapter")

    ``"module:Class"`` strings keep the adapter module unimported until an architecture it declares is used.
    """

    @hookimpl
    def afd_register_model_adapters(register: Callable[..., None]) -> None:
        for adapter in adapters:
            register_adapter(register, adapter)

    return afd_register_model_adapters


def register_adapter(register: Callable[..., None], adapter: type[ModelAdapter] | str) -> None:
    """Register ``adapter`` under every architecture it declares (``architectures``).

    For an ``afd_register_model_adapters`` hook::

        @hookimpl
        def afd_register_model_adapters(register):
            register_adapter(register, "my_models.adapter:MixtralAdapter")

    A lazy ``"module:Class"`` target is imported here to read its
    architectures (adapter modules import no framework) and registered as the
    string, so nothing else is resolved before use.
    """
    cls = resolve_target(adapter, what="model adapter") if isinstance(adapter, str) else adapter
    if not (isinstance(cls, type) and issubclass(cls, ModelAdapter)) or not cls.architectures:
        raise PluginLoadError(f"model adapter {adapter!r} is no ModelAdapter subclass declaring its architectures")
    for architecture in cls.architectures:
        register(architecture, adapter)
