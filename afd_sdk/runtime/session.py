"""Open one role: validate everything, load the role's model, build (not init) the connector.

Order matters (validate before resources): config → plugin vetoes → adapter
feature rules → weights → connector construction. Nothing opens a socket
until the caller runs ``connector.init()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from afd_sdk.adapter import Binding, Deployment, ExtraSpec, ModelAdapter, MoELayout, resolve_target
from afd_sdk.config import AFDConfig, parse_config
from afd_sdk.connector import AFDConnector, ConnectorBase, ConnectorContext
from afd_sdk.errors import AFDConfigError
from afd_sdk.metadata import MetadataProvider
from afd_sdk.plugins import ResolvedConfig, adapter_for, get_plugin_manager
from afd_sdk.runtime.worlds import world_configs
from afd_sdk.topology import AttentionFirstWorld
from afd_sdk.weights import read_hf_config
from afd_sdk.wire import ModelFingerprint, dtype_from_name

__all__ = [
    "RoleSession",
    "build_connector",
    "connector_from_spec",
    "open_role",
    "resolve_role",
    "validate_role",
    "world_connectors",
]


@dataclass
class RoleSession:
    """Everything one worker needs, resolved once at start-up."""

    config: AFDConfig
    adapter: ModelAdapter
    model: torch.nn.Module
    connector: ConnectorBase
    provider: MetadataProvider
    fingerprint: ModelFingerprint
    num_layers: int
    hidden_size: int
    model_dir: Path
    binding: Binding
    #: one connector per world this role serves (``open_role(ports=...)``); ``connector`` is the first
    connectors: list[ConnectorBase] = field(default_factory=list)


def build_connector(
    resolved: ResolvedConfig,
    *,
    role_rank: int,
    model: ModelFingerprint,
    ffn_extras: tuple[ExtraSpec, ...] = (),
    max_num_tokens: int = 8192,
    moe: MoELayout | None = None,
    device: str = "cpu",
) -> ConnectorBase:
    """Compute the world once and construct (not ``init``) the resolved connector.

    The one place a connector is built: the runtime, the benchmarks and the
    conformance workers all come through here, so they build it the same way.
    """
    cls = resolved.connector_cls
    # an async-dispatch connector without the model's experts is reported by its constructor (key "moe")
    world = None if cls.capabilities.async_dispatch and moe is None else cls.world_for(resolved.config, moe)
    cfg = resolved.config
    context = ConnectorContext(
        config=cfg,
        role_rank=role_rank,
        model=model,
        extra_config=resolved.extra_config,
        ffn_extras=tuple(ffn_extras),
        max_num_tokens=max_num_tokens,
        device=device,
        moe=moe,
        world=world,
    )
    if cfg.ffn_replicas == 1 or cfg.role == "ffn":  # an FFN replica is an ordinary world (afd ffn serve --replica)
        return cls(context)
    if not issubclass(cls, AFDConnector):  # resolve_config refused routed dispatch with replicas already
        raise AFDConfigError(
            f"afd.ffn_replicas={cfg.ffn_replicas} needs a point-to-point connector; {cls.__name__} is not an "
            "AFDConnector",
            key="afd.ffn_replicas",
            value=cfg.ffn_replicas,
        )
    from afd_sdk.runtime.failover import FailoverConnector, replica_world

    def replica(k: int, failover: bool) -> AFDConnector:
        # start-up waits connect_timeout_s for replica 0; a failover's handshake with a standby is bounded by
        # timeout_s: a dead one costs one deadline
        timeout = min(cfg.connect_timeout_s, cfg.timeout_s) if failover else cfg.connect_timeout_s
        # one replica's world: ffn_replicas=1 there (the replica set was validated on the unshifted config)
        one = replica_world(cfg, k, connect_timeout_s=timeout)
        return cls(dataclasses.replace(context, config=one))

    return FailoverConnector(context, replica, cfg.ffn_replicas, handshake_s=cfg.timeout_s)


def world_connectors(resolved: ResolvedConfig, ports: Sequence[int], **build: Any) -> list[ConnectorBase]:
    """:func:`build_connector` once per world: one per port (``afd.port`` replaced), or one when ``ports`` is empty.

    ``build`` are :func:`build_connector`'s keyword arguments, the same for every world.
    """
    return [
        build_connector(dataclasses.replace(resolved, config=world), **build)
        for world in world_configs(resolved.config, ports)
    ]


def connector_from_spec(spec: Mapping[str, Any]) -> ConnectorBase:
    """:func:`build_connector` from a world spec (the JSON each worker of ``run_world`` gets).

    Keys: ``afd`` (the mapping without ``role``), ``role``, ``rank``,
    ``model`` (fingerprint fields), optional ``extras``, ``moe``
    (``num_experts``, ``top_k``, ``layers``), ``max_num_tokens`` (a number, or
    ``{"attention": n, "ffn": m}`` when the roles size their buffers differently,
    as vLLM engines with different ``max_num_batched_tokens`` do) and
    ``connector_target`` (``"module:Class"`` of an unregistered connector).
    """
    cfg = parse_config({**spec["afd"], "role": spec["role"]})
    target = spec.get("connector_target")
    if target:
        cls = resolve_target(target, what="connector_target")
        cls.validate_config(cfg)
        resolved = ResolvedConfig(cfg, cls, cls.parse_extra_config(cfg.connector_extra_config))
    else:
        resolved = get_plugin_manager().resolve_config(cfg)
    m = spec["model"]
    fingerprint = ModelFingerprint(
        m["architecture"],
        m["hidden_size"],
        m["dtype"],
        m["num_layers"],
        m.get("adapter", ""),
        m.get("adapter_version", ""),
    )
    extras = tuple(ExtraSpec(e["name"], e["dtype"], tuple(e.get("trailing_shape", ()))) for e in spec.get("extras", []))
    moe = spec.get("moe")
    layout = MoELayout(moe["num_experts"], moe["top_k"], tuple(moe["layers"])) if moe else None
    return build_connector(
        resolved,
        role_rank=spec["rank"],
        model=fingerprint,
        ffn_extras=extras,
        max_num_tokens=tokens[spec["role"]] if isinstance(tokens := spec.get("max_num_tokens", 4096), dict) else tokens,
        moe=layout,
    )


def _text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    return hf_config.get("text_config") or hf_config


def validate_role(
    config: object, model_dir: str | Path, *, dtype: str = "float32"
) -> tuple[AFDConfig, Any, ModelAdapter, ModelFingerprint]:
    """Every check that needs no resource; returns what :func:`open_role` builds on."""
    model_path = Path(model_dir)
    if not (model_path / "config.json").is_file():
        raise AFDConfigError(
            f"--model {str(model_dir)!r} has no config.json; expected a HF checkpoint directory",
            key="model",
            value=str(model_dir),
        )
    hf_config = read_hf_config(model_path)
    # the reference runtime serves text, one stage of layers, no adapters: what it knows is the quantization
    quant = hf_config.get("quantization_config")
    quantization = quant.get("quant_method") if isinstance(quant, Mapping) else None
    return resolve_role(
        config, hf_config, dtype=dtype, source=str(model_path / "config.json"), features={"quantization": quantization}
    )


def resolve_role(
    config: object,
    hf_config: Mapping[str, Any],
    *,
    dtype: str = "float32",
    device: str = "cpu",
    engine: str = "reference",
    source: str = "config.json",
    features: Mapping[str, Any] | None = None,
) -> tuple[AFDConfig, ResolvedConfig, ModelAdapter, ModelFingerprint]:
    """Validate one role against a model's HF config: config, plugin vetoes, the adapter's feature rules.

    Shared by the reference runtime (:func:`validate_role`) and the vLLM
    integration, which has the HF config in hand. ``engine`` names who runs
    the model (``"reference"`` splits micro-batches at request boundaries;
    ``"vllm"`` runs one stage per forward); ``features`` are further
    :class:`~afd_sdk.adapter.Deployment` fields the engine knows (pipeline
    parallelism, EPLB, LoRA, ...). Opens nothing.
    """
    cfg = parse_config(config)
    pm = get_plugin_manager()
    resolved = pm.resolve_config(cfg)
    if not hf_config.get("architectures"):
        raise AFDConfigError(f"{source!r} has no 'architectures'", key="architectures")
    adapter = adapter_for(hf_config)
    arch = adapter.architecture
    if getattr(resolved.extra_config, "async_moe_split", "request") == "token":
        raise AFDConfigError(
            "afd.connector_extra_config.async_moe_split='token' is not offered by the reference runtime, which "
            "splits micro-batches at request boundaries; use 'request'",
            key="afd.connector_extra_config.async_moe_split",
            value="token",
        )
    if resolved.connector_cls.capabilities.async_dispatch and adapter.moe_layout() is None:
        raise AFDConfigError(
            f"connector={resolved.connector_cls.name!r} dispatches routed experts, and {arch} declares none; "
            "use a point-to-point connector (zmq, p2p, shm) for a dense model",
            key="connector",
            value=resolved.connector_cls.name,
        )
    if engine == "vllm" and cfg.num_stages != 1:
        raise AFDConfigError(
            f"afd.num_stages={cfg.num_stages} is not offered inside vLLM's engine, which runs one forward per "
            "step (vLLM's own micro-batching, DBO, is CUDA-only); use 1, or the reference runtime for micro-batches",
            key="afd.num_stages",
            value=cfg.num_stages,
        )
    adapter.validate_deployment(
        Deployment(
            device=device,
            connector=resolved.connector_cls.name,
            capabilities=resolved.connector_cls.capabilities,
            compute_gate_on_attention=cfg.compute_gate_on_attention,
            num_stages=cfg.num_stages,
            **(features or {}),
        )
    )
    text = _text_config(dict(hf_config))
    dtype_from_name(dtype)
    fingerprint = ModelFingerprint(
        architecture=arch,
        hidden_size=int(text["hidden_size"]),
        dtype=dtype,
        num_layers=int(text["num_hidden_layers"]),
        adapter=adapter.name,
        adapter_version=adapter.version,
    )
    return cfg, resolved, adapter, fingerprint


def open_role(
    config: object,
    model_dir: str | Path,
    *,
    role_rank: int = 0,
    dtype: str = "float32",
    max_num_tokens: int = 8192,
    ports: Sequence[int] = (),
) -> RoleSession:
    """Validate, load this role's weights and construct its connector (not initialised).

    ``ports`` (FFN role): one connector per port, each an independent world
    served with the same weights (:mod:`afd_sdk.runtime.worlds`).
    """
    cfg, resolved, adapter, fingerprint = validate_role(config, model_dir, dtype=dtype)
    if ports and cfg.role != "ffn":
        raise AFDConfigError(
            f"ports={list(ports)} is an FFN-role option; an attention rank belongs to one world",
            key="ports",
            value=list(ports),
        )
    pm = get_plugin_manager()
    provider = pm.metadata_provider("contextvar")
    binding = adapter.binding("transformers")
    moe = adapter.moe_layout()
    # constructed before the weights load: it opens nothing, and its world (computed once) places the experts
    connectors = world_connectors(
        resolved,
        ports,
        role_rank=role_rank,
        model=fingerprint,
        ffn_extras=adapter.ffn_extras(),
        max_num_tokens=max_num_tokens,
        moe=moe,
    )
    connector = connectors[0]
    experts = None
    if cfg.role == "ffn" and cfg.compute_gate_on_attention and isinstance(connector.world, AttentionFirstWorld):
        experts = connector.world.local_experts(role_rank)
    model, _ = binding.load_role(
        adapter,
        model_dir,
        cfg.role,
        provider=provider,
        dtype=dtype_from_name(dtype),
        compute_gate_on_attention=cfg.compute_gate_on_attention,
        experts=experts,
    )
    return RoleSession(
        cfg,
        adapter,
        model,
        connector,
        provider,
        fingerprint,
        fingerprint.num_layers,
        fingerprint.hidden_size,
        Path(model_dir),
        binding,
        connectors,
    )
