"""The ``AFD<arch>`` alias model classes: one class, constructed by role.

* **Attention role** — vLLM's native model (attention, norms, embeddings, LM
  head, KV cache) with each decoder layer's FFN module replaced by the
  parameter-free :class:`~afd_sdk.proxy.RemoteFFN` the transformers binding
  places too. Inside vLLM's engine every ``forward`` is one AFD step: the
  model announces it on the connector's control plane and installs the
  forward metadata in vLLM's ``ForwardContext``; the connector is built when
  the model is constructed (nothing opens) and initialised at the first
  forward (vLLM's profile run), closed at process exit.
* **FFN role** — only each layer's FFN module, built by the adapter's
  :class:`~afd_sdk.integrations.vllm.binding.VllmBinding` with vLLM's own
  classes (``FusedMoE`` blocks, dense MLPs); no attention, no KV cache. It is
  driven by :mod:`afd_sdk.integrations.vllm.ffn`, never by vLLM's scheduler.

Each role's ``load_weights`` passes on only the tensors that role loads
(the adapter's classification); vLLM's loader then checks that every
parameter of the role was initialised.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import re
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from afd_sdk.adapter import ModelAdapter, WeightRole, afd_alias, resolve_target
from afd_sdk.config import AFDConfig
from afd_sdk.connector import ConnectorBase
from afd_sdk.errors import AFDConfigError, ConnectorError, UnclassifiedWeightError, UnsupportedFeatureError
from afd_sdk.integrations.vllm.binding import FFNOnlyLayer, VllmBinding
from afd_sdk.integrations.vllm.plugin import afd_config_from_vllm
from afd_sdk.integrations.vllm.provider import VllmMetadataProvider
from afd_sdk.integrations.vllm.release import construct_on_meta, drop_vllm_references, track
from afd_sdk.integrations.vllm.routed import LocalExperts, place_remote_routed_experts
from afd_sdk.metadata import ForwardMetadata
from afd_sdk.metrics import AFDMetrics, default_hub
from afd_sdk.proxy import FFNOutput, RoutedExperts, module_at, place_remote_ffn
from afd_sdk.runtime.attention_runner import RunnerConnector, announce_step
from afd_sdk.runtime.ops_server import OpsServer, start_ops_server
from afd_sdk.runtime.session import build_connector, resolve_role
from afd_sdk.wire import ControlPayload, dtype_to_name

__all__ = ["EngineAttentionSide", "afd_filter_weights", "afd_model_class", "lazy_alias_classes", "vllm_binding"]

logger = logging.getLogger(__name__)


def lazy_alias_classes(module: str, natives: Mapping[str, str] | None, adapter_cls: type[ModelAdapter]) -> Any:
    """A module ``__getattr__`` that builds ``AFD<arch>`` classes on first access: an adapter package's whole
    alias module is ``__getattr__ = lazy_alias_classes(__name__, None, MyAdapter)``.

    ``natives`` maps architecture -> vLLM module holding its native class (named like the architecture);
    ``None`` asks vLLM's own model registry for every architecture the adapter declares (its module and class
    name, or the class registered). vLLM's
    registry imports ``module`` and reads ``AFD<arch>``; only that architecture's native module is imported,
    and the class pickles by reference (its ``__module__`` is ``module``).
    """

    def native_class(arch: str) -> type | None:
        if natives is not None:
            where = natives.get(arch)
            return None if where is None else getattr(importlib.import_module(where), arch)
        if arch not in adapter_cls.architectures:
            return None
        from vllm import ModelRegistry

        entry = ModelRegistry.models.get(arch)
        if entry is None:
            return None
        if hasattr(entry, "model_cls"):  # registered as a class
            return entry.model_cls
        return getattr(importlib.import_module(entry.module_name), entry.class_name)

    def __getattr__(name: str) -> type:
        arch = name.removeprefix("AFD")
        native = native_class(arch) if name.startswith("AFD") else None
        if native is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        cls = afd_model_class(native, arch, adapter_cls, module=module)
        setattr(sys.modules[module], name, cls)
        return cls

    return __getattr__


def vllm_binding(adapter: ModelAdapter) -> VllmBinding:
    """The adapter's vLLM binding; an adapter without one supports the Attention role's default cut only."""
    if "vllm" not in adapter.bindings:
        raise AFDConfigError(
            f"adapter {adapter.name} declares no vLLM binding for {adapter.architecture} "
            "(bindings['vllm']); its FFN role cannot be built from vLLM's modules",
            key="architecture",
            value=adapter.architecture,
        )
    binding = adapter.binding("vllm")
    if not isinstance(binding, VllmBinding):
        raise AFDConfigError(
            f"adapter {adapter.name}'s vLLM binding returned {type(binding).__name__}; expected a VllmBinding",
            key="bindings.vllm",
            value=adapter.bindings["vllm"],
        )
    return binding


def _deployment_features(vllm_config: Any) -> dict[str, Any]:
    """The :class:`~afd_sdk.adapter.Deployment` fields vLLM's config decides (for the adapter's feature rules)."""
    pc = vllm_config.parallel_config
    return {
        "pipeline_parallel_size": int(getattr(pc, "pipeline_parallel_size", 1)),
        "eplb": bool(getattr(pc, "enable_eplb", False)),
        "sequence_parallel_moe": bool(getattr(pc, "use_sequence_parallel_moe", False)),
        "speculative_decoding": getattr(vllm_config, "speculative_config", None) is not None,
        "lora": getattr(vllm_config, "lora_config", None) is not None,
        "quantization": getattr(vllm_config.model_config, "quantization", None),
    }


def _platform() -> str:
    from vllm.platforms import current_platform

    return "cuda" if current_platform.is_cuda_alike() else "npu" if current_platform.device_type == "npu" else "cpu"


def _role_rank(cfg: AFDConfig, vllm_config: Any) -> int:
    """This process's rank in its role: vLLM's data-parallel rank when DP > 1 (one engine per attention rank).

    ``data_parallel_index`` is the global DP rank in every launch shape (``--data-parallel-size N``, and
    ``--headless --data-parallel-start-rank R`` on another node); vLLM keeps it when it turns a dense
    model's DP ranks into independent engines (``data_parallel_size`` 1), which AFD refuses: independent
    engines step on their own schedule, so one world's FFN would wait for the idle ones.
    """
    pc = vllm_config.parallel_config
    if cfg.role != "attention":
        return cfg.server_rank
    size = int(getattr(pc, "data_parallel_size", 1))
    index = int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0)
    if size > 1:
        return index
    if index > 0:
        raise AFDConfigError(
            f"vLLM runs data-parallel rank {index} of this model as an independent engine (a dense model: no "
            "lockstep across DP ranks), so its ranks cannot share one AFD world; expected an MoE model, or one "
            "`vllm serve` per world with its own afd.port and num_attention_ranks=1",
            key="afd.num_attention_ranks",
            value=cfg.num_attention_ranks,
        )
    return cfg.server_rank


def _local_rank(vllm_config: Any) -> int:
    """This engine's data-parallel rank among the engines of its host (0 without DP)."""
    pc = vllm_config.parallel_config
    if int(getattr(pc, "data_parallel_size", 1)) <= 1:
        return 0
    return int(getattr(pc, "data_parallel_rank_local", 0) or 0)


def resolve_in_vllm(cfg: AFDConfig, vllm_config: Any, architecture: str) -> tuple[Any, ModelAdapter, Any]:
    """Validate the AFD config against vLLM's model config; returns ``(resolved, adapter, fingerprint)``."""
    model_config = vllm_config.model_config
    hf = model_config.hf_config.to_dict()
    hf["architectures"] = [architecture]
    _, resolved, adapter, fingerprint = resolve_role(
        cfg,
        hf,
        dtype=dtype_to_name(model_config.dtype),
        device=_platform(),
        engine="vllm",
        source=f"{model_config.model}/config.json",
        features=_deployment_features(vllm_config),
    )
    return resolved, adapter, fingerprint


class EngineAttentionSide:
    """The Attention role's AFD state inside one vLLM worker.

    Built by the alias model's constructor (validates, constructs the
    connector: nothing opens); :meth:`step` is called by the model's
    ``forward`` once per engine step — it initialises the connector on the
    first call (vLLM's profile run), announces the step on the control
    plane and returns the forward metadata to install. :meth:`close` sends
    the goodbye; it runs at process exit or when vLLM shuts the worker down.

    With ``afd.metrics_port``, this worker serves ``/metrics``, ``/healthz``
    and ``/readyz`` on ``metrics_port + its local data-parallel rank`` (the
    data-parallel engines of one host share the config) from construction
    on, and records every exchange and step.
    """

    def __init__(
        self,
        cfg: AFDConfig,
        vllm_config: Any,
        architecture: str,
        adapter: ModelAdapter,
        resolved: Any,
        fingerprint: Any,
    ) -> None:
        self.config = cfg
        self.num_layers = fingerprint.num_layers
        self.provider = VllmMetadataProvider()
        max_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        self.connector: ConnectorBase = build_connector(
            resolved,
            role_rank=_role_rank(cfg, vllm_config),
            model=fingerprint,
            ffn_extras=adapter.ffn_extras(),
            max_num_tokens=max_tokens,
            moe=adapter.moe_layout(),
        )
        self._steps = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self.metrics: AFDMetrics | None = None
        self._data: Any = self.connector  # what the FFN proxies call: the connector, or its metered wrapper
        ops: OpsServer | None = None
        if cfg.metrics_port is not None:
            # the engines of one host share the config: each takes metrics_port + its local DP rank (a pod
            # of one rank, as in deploy/k8s, serves on metrics_port itself)
            rank = _local_rank(vllm_config)
            if cfg.metrics_port + rank > 65535:
                raise AFDConfigError(
                    f"afd.metrics_port={cfg.metrics_port} + local data-parallel rank {rank} exceeds 65535; "
                    "expected a port that leaves room for every rank of this host",
                    key="afd.metrics_port",
                    value=cfg.metrics_port,
                )
            self.metrics = default_hub().for_connector(self.connector)
            self._data = RunnerConnector(self.connector, None, None, self.metrics)  # type: ignore[arg-type]
            ops = start_ops_server(cfg.replace(metrics_port=cfg.metrics_port + rank), default_hub())
        # vLLM does not tell a model that its worker stops; the goodbye is sent at exit at the latest
        # (a finalizer runs at interpreter exit, or when this side is collected, whichever comes first)
        self._finalizer = weakref.finalize(
            self, EngineAttentionSide._close_connector, self.connector, self.metrics, ops
        )

    @staticmethod
    def _close_connector(connector: ConnectorBase, metrics: AFDMetrics | None, ops: OpsServer | None) -> None:
        try:
            connector.close()
        except Exception:  # at exit there is no caller left to raise to; say what failed
            logger.exception("afd-sdk: closing %s at exit failed", connector.display_name)
        if metrics is not None and metrics.peer_state == "connected":
            metrics.set_peer_state("closed")
        if ops is not None:
            ops.close()

    def step(self, num_tokens: int) -> ForwardMetadata:
        """Announce one forward of ``num_tokens`` tokens; the metadata the FFN proxies read during it."""
        conn = self.connector
        if not conn.is_initialized:
            with self._lock:
                if self._closed:
                    raise ConnectorError("the AFD attention side was closed; the engine cannot run another step")
                if not conn.is_initialized:
                    conn.init()
                    if self.metrics is not None:
                        self.metrics.set_peer_state("connected")
        step = next(self._steps)
        announce_step(conn, ControlPayload(step, ((num_tokens,),), num_tokens, self.num_layers))
        if self.metrics is not None:
            self.metrics.observe_step(num_tokens)
        return ForwardMetadata(
            0, 1, (0,), (num_tokens,), (num_tokens,), (0,), connector=self._data, transaction_id=step
        )

    def close(self) -> None:
        """Say goodbye to the FFN peers and release the connector. Idempotent."""
        self._closed = True
        self._finalizer()


def _num_tokens(input_ids: Any, positions: Any, inputs_embeds: Any) -> int:
    if input_ids is not None:
        return int(input_ids.shape[0])
    if inputs_embeds is not None:
        return int(inputs_embeds.shape[0])
    return int(positions.shape[-1])


def afd_model_class(
    native: type,
    architecture: str,
    adapter_cls: type[ModelAdapter],
    *,
    module: str | None = None,
) -> type:
    """Subclass vLLM's ``native`` model class as ``AFD<architecture>``, constructed by role.

    The role comes from ``vllm_config.additional_config["afd"]``; selecting an
    AFD alias without an ``afd`` config is an ``AFDConfigError``. Validation
    (config, connector, the adapter's feature rules against vLLM's config)
    runs before anything is built. See the module docstring for what each
    role constructs; ``load_weights`` passes on only the role's tensors and
    raises ``UnclassifiedWeightError`` for a name no rule covers.
    """

    def __init__(self: Any, *, vllm_config: Any, prefix: str = "") -> None:
        cfg = afd_config_from_vllm(vllm_config)
        if cfg is None:
            raise AFDConfigError(
                f'{afd_alias(architecture)} needs --additional-config \'{{"afd": {{"role": ...}}}}\'; '
                f"use {architecture} for a non-AFD deployment",
                key="afd",
            )
        resolved, adapter, fingerprint = resolve_in_vllm(cfg, vllm_config, architecture)
        binding = None
        if cfg.compute_gate_on_attention:
            binding = vllm_binding(adapter)
            if binding.build_local_experts is None:
                raise adapter.reject(
                    "compute_gate_on_attention",
                    True,
                    "False inside vLLM's engine (this architecture's vLLM binding offers no routed-expert split)",
                )
        self.afd_config = cfg
        self.afd_adapter = adapter
        self.afd_experts = None
        if cfg.role == "ffn":
            binding = binding or vllm_binding(adapter)
            if cfg.compute_gate_on_attention:
                world = resolved.connector_cls.world_for(cfg, adapter.moe_layout())
                self.afd_experts = world.local_experts(cfg.server_rank)
            _build_ffn_role(self, vllm_config, binding, fingerprint.num_layers, prefix, adapter, self.afd_experts)
            self.afd_attention = None
            return
        with construct_on_meta(() if cfg.compute_gate_on_attention else _ffn_classes(adapter)):
            native.__init__(self, vllm_config=vllm_config, prefix=prefix)
        layers_path, ffn_attr, output = _attention_cut(adapter)
        side = EngineAttentionSide(cfg, vllm_config, architecture, adapter, resolved, fingerprint)
        self.afd_attention = side
        layers = module_at(self, layers_path)
        moe = adapter.moe_layout()
        if cfg.compute_gate_on_attention and moe is not None:
            # the runners stay (their routing and shared experts run here); their expert tensors go
            routed = [getattr(layers[i], ffn_attr).experts.routed_experts for i in moe.moe_layers]
            self.afd_replaced = track(routed)
            place_remote_routed_experts(layers, ffn_attr, moe.moe_layers, side.provider)
        else:
            replaced = [getattr(layer, ffn_attr) for layer in layers]
            self.afd_replaced = track(replaced)
            place_remote_ffn(layers, ffn_attr, side.provider, adapter.ffn_extras(), output)
            # the replaced modules' names, as vLLM registered them: under the constructor's prefix (empty for a
            # top-level model), at ``layers_path``
            base = f"{prefix}.{layers_path}" if prefix else layers_path
            qualified = [f"{base}.{i}.{ffn_attr}" for i in range(len(replaced))]
            drop_vllm_references(self, vllm_config, qualified, replaced)
            del replaced
        self.afd_replaced = self.afd_replaced.without(self)

    def forward(
        self: Any,
        input_ids: Any,
        positions: Any,
        intermediate_tensors: Any = None,
        inputs_embeds: Any = None,
        **kwargs: Any,
    ) -> Any:
        side = self.afd_attention
        if side is None:
            raise ConnectorError(
                f"{afd_alias(architecture)} was built for the FFN role; its layers are served by "
                "`afd ffn serve --engine vllm`, never run by vLLM's scheduler"
            )
        md = side.step(_num_tokens(input_ids, positions, inputs_embeds))
        with side.provider.install(md):
            return native.forward(self, input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)

    def load_weights(self: Any, weights: Iterable[tuple[str, Any]]) -> Any:
        filtered = afd_filter_weights(self.afd_adapter, self.afd_config, weights)
        if self.afd_experts is not None:  # FFN role, gate on Attention: this rank's block of routed experts
            moe = self.afd_adapter.moe_layout()
            filtered = local_expert_weights(filtered, self.afd_experts, moe.num_experts)
        if self.afd_config.role == "ffn":
            from vllm.model_executor.models.utils import AutoWeightsLoader

            try:
                return AutoWeightsLoader(self).load_weights(filtered)
            except AttributeError as exc:
                err = missing_inner_attr(exc, self, architecture)
                if err is None:
                    raise
                raise err from exc
        return native.load_weights(self, filtered)

    name = afd_alias(architecture)
    attrs = {
        "__init__": __init__,
        "forward": forward,
        "load_weights": load_weights,
        "__qualname__": name,
        "afd_architecture": architecture,
        "__module__": module or native.__module__,
    }
    return type(name, (native,), attrs)


def missing_inner_attr(exc: AttributeError, model: Any, architecture: str) -> AFDConfigError | None:
    """The binding error behind an ``AttributeError`` raised while the FFN role loads its weights, or ``None``.

    The FFN role's decoder stack is the native class built without its ``__init__``, so every attribute its
    ``load_weights`` reads must come from ``VllmBinding.inner_attrs``; a missing one surfaces as a bare
    ``AttributeError`` deep in vLLM. This names the attribute and the key to set instead.
    """
    binding_inner = getattr(model, "afd_inner_attrs", None)
    inner = getattr(exc, "obj", None)
    if binding_inner is None or inner is None or not hasattr(model, "afd_inner_class"):
        return None
    if not isinstance(inner, model.afd_inner_class):
        return None
    cls = model.afd_inner_class
    return AFDConfigError(
        f"{cls.__module__}.{cls.__qualname__}.load_weights reads attribute {exc.name!r}, which the FFN role's "
        f"{cls.__qualname__} lacks (its __init__ never runs); return {exc.name!r} from the {architecture} adapter's "
        f"VllmBinding.inner_attrs(vllm_config, layers) (it returned {sorted(binding_inner) or 'nothing'})",
        key="VllmBinding.inner_attrs",
        value=exc.name,
    )


def _attention_cut(adapter: ModelAdapter) -> tuple[str, str, FFNOutput]:
    """Where the Attention role places its proxies and what they return: the vLLM binding's, or the
    adapter's declared cut (``layers_path``, ``ffn_attr``, ``ffn_output``)."""
    if "vllm" in adapter.bindings:
        try:
            binding = vllm_binding(adapter)
        except UnsupportedFeatureError:  # no FFN-role construction for this architecture; the cut is the declared one
            return adapter.layers_path, adapter.ffn_attr, adapter.ffn_output
        return binding.layers_path, binding.ffn_attr, binding.ffn_output or adapter.ffn_output
    return adapter.layers_path, adapter.ffn_attr, adapter.ffn_output


def _ffn_classes(adapter: ModelAdapter) -> tuple[str, ...]:
    """The FFN module classes the Attention role builds on the meta device: its vLLM binding's, if any."""
    if "vllm" not in adapter.bindings:
        return ()
    try:
        return vllm_binding(adapter).ffn_classes
    except UnsupportedFeatureError:  # no vLLM construction for this architecture: nothing declared
        return ()


def _build_ffn_role(
    model: Any,
    vllm_config: Any,
    binding: VllmBinding,
    num_layers: int,
    prefix: str,
    adapter: ModelAdapter,
    experts: range | None,
) -> None:
    """The FFN role's model: every layer's native FFN module under its native name, nothing else.

    ``model.<inner_attr>`` is an instance of the native decoder-stack class
    (so its ``load_weights`` maps checkpoint names) that holds only
    :class:`FFNOnlyLayer` s: its ``__init__`` — which would build attention —
    never runs. With ``experts`` (gate on Attention), each MoE layer's FFN
    module holds only ``experts``: this rank's block of routed experts, as a
    vLLM ``FusedMoE`` (:mod:`afd_sdk.integrations.vllm.routed`); dense layers
    stay on Attention and hold nothing here.
    """
    torch.nn.Module.__init__(model)
    inner_cls = resolve_target(binding.inner_class, what="vLLM binding inner_class")
    inner = inner_cls.__new__(inner_cls)
    torch.nn.Module.__init__(inner)
    moe = adapter.moe_layout()
    moe_layers = set(moe.moe_layers) if moe is not None else set()

    def block(i: int) -> torch.nn.Module:
        ffn_prefix = binding.ffn_prefix(i, prefix)
        if experts is None:
            return binding.build_ffn(vllm_config, i, ffn_prefix)
        holder = torch.nn.Module()
        if i in moe_layers:
            assert binding.build_local_experts is not None
            holder.experts = binding.build_local_experts(vllm_config, i, f"{ffn_prefix}.experts", len(experts))
        return holder

    layers = torch.nn.ModuleList(FFNOnlyLayer(binding.ffn_attr, block(i)) for i in range(num_layers))
    given = dict(binding.inner_attrs(vllm_config, layers))
    for key, value in given.items():
        setattr(inner, key, value)
    model.afd_inner_class, model.afd_inner_attrs = inner_cls, tuple(given)  # named by missing_inner_attr
    setattr(inner, binding.layers_attr, layers)
    inner.start_layer, inner.end_layer = 0, num_layers
    setattr(model, binding.inner_attr, inner)
    model.afd_ffn_layers = [layer.block() for layer in layers]
    model.afd_ffn_output = binding.ffn_output or adapter.ffn_output
    if experts is not None:
        local = {i: LocalExperts(layers[i].block().experts, vllm_config) for i in sorted(moe_layers)}
        model.afd_routed_experts = RoutedExperts(local, experts.start, len(experts))


_PER_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)(\..+)$")


def local_expert_weights(
    weights: Iterable[tuple[str, Any]], block: range, num_experts: int
) -> Iterator[tuple[str, Any]]:
    """The FFN-role tensors an FFN rank holding experts ``block`` loads, renumbered from 0.

    Per-expert names (``….experts.7.up_proj.weight``) outside the block are
    skipped; fused ``[num_experts, …]`` tensors (``….experts.gate_up_proj``) are
    cut to the block's rows. Called on names the role filter already kept
    (routed experts only: the gate and shared experts stay on Attention).
    """
    for name, tensor in weights:
        m = _PER_EXPERT.match(name)
        if m is not None:
            e = int(m.group(2))
            if e in block:
                yield f"{m.group(1)}{e - block.start}{m.group(3)}", tensor
        elif ".experts." in name and tensor.shape and tensor.shape[0] == num_experts:
            yield name, tensor[block.start : block.stop]
        else:
            yield name, tensor


def afd_filter_weights(
    adapter: ModelAdapter, config: AFDConfig, weights: Iterable[tuple[str, Any]]
) -> Iterator[tuple[str, Any]]:
    """Yield only the ``(name, tensor)`` pairs ``config.role`` loads; unclassified names raise.

    With the gate on Attention the FFN role holds routed experts only: tensors
    both roles may load (the router gate) stay on Attention.
    """
    role, gate = config.role, config.compute_gate_on_attention
    routed_only = gate and role == "ffn"
    for name, tensor in weights:
        r = adapter.weight_role(name, compute_gate_on_attention=gate)
        if r is None:
            raise UnclassifiedWeightError(adapter.architecture, [name])
        if (r is WeightRole.FFN) if routed_only else r.loaded_by(role):
            yield name, tensor
