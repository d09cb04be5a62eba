"""vLLM integration: the ``vllm.general_plugins`` entry point, AFD model aliases,
the ``ForwardContext`` metadata provider, and the ``additional_config["afd"]`` channel.

vLLM calls :func:`register` in every process that loads its plugins
(``vllm.plugins.load_general_plugins``). Nothing here imports vLLM at module
import time; without vLLM, :func:`register` does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from afd_sdk.adapter import ModelAdapter, afd_alias
from afd_sdk.config import AFDConfig, parse_config
from afd_sdk.errors import AFDConfigError, PluginLoadError
from afd_sdk.metadata import ForwardMetadata, MetadataProvider

__all__ = [
    "METADATA_KEY",
    "VllmMetadataProvider",
    "afd_config_from_vllm",
    "afd_model_class",
    "lazy_alias_classes",
    "register",
    "register_model_aliases",
    "worker_classes",
]

logger = logging.getLogger(__name__)

#: where the forward metadata lives inside vLLM's ForwardContext
METADATA_KEY = "afd_metadata"

_registered = False
_register_lock = threading.Lock()
_MISSING = object()


def register() -> None:
    """Entry point of ``vllm.general_plugins`` (name ``afd``). Idempotent per process.

    Registers ``AFD<arch>`` with vLLM's ``ModelRegistry`` for every installed
    adapter that declares a vLLM class, lazily (``"module:Class"``; no model
    module is imported here). A failure of the registry itself propagates and
    leaves the plugin unregistered so a later call retries; an adapter whose
    plugin failed to load is skipped with a warning naming the cause.
    """
    global _registered
    with _register_lock:
        if _registered:
            return
        try:
            from vllm import ModelRegistry
        except ImportError as exc:
            logger.debug("afd-sdk vLLM plugin: vLLM is not importable (%s); nothing to register", exc)
            return
        from afd_sdk.plugins import get_plugin_manager

        names = register_model_aliases(ModelRegistry, get_plugin_manager())
        _registered = True
        logger.info("afd-sdk registered %d AFD model aliases with vLLM", len(names))


def register_model_aliases(registry: Any, pm: Any) -> list[str]:
    """Register ``AFD<arch>`` -> the adapter's vLLM class path with ``registry``; return the aliases."""
    for failed in pm.failures():
        logger.warning("afd-sdk plugin %s (%s) failed to load; its models get no vLLM alias: %s",
                       failed.name, failed.distribution or "no distribution", failed.error)  # fmt: skip
    done = []
    for arch in pm.model_adapters.names():
        try:
            adapter_cls: type[ModelAdapter] = pm.adapter_class(arch)
        except PluginLoadError as exc:
            logger.warning("afd-sdk: no vLLM alias for %s: its adapter failed to load: %r", arch, exc.cause or exc)
            continue
        target = adapter_cls.vllm_models.get(arch)
        if target is None:
            logger.debug("afd-sdk: adapter %s declares no vLLM class for %s", adapter_cls.name, arch)
            continue
        registry.register_model(afd_alias(arch), target)
        done.append(afd_alias(arch))
    return done


# --- config channel -------------------------------------------------------------


def afd_config_from_vllm(vllm_config: Any) -> AFDConfig | None:
    """``additional_config["afd"]`` of a ``VllmConfig`` parsed strictly; ``None`` when AFD is off."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    if "afd" not in additional:
        return None
    return parse_config(additional)


_WORKERS = {
    "cuda": "vllm.v1.worker.gpu_worker.Worker",
    "cpu": "vllm.v1.worker.cpu_worker.CPUWorker",
}


def worker_classes(role: str, platform: str) -> dict[str, str]:
    """Class paths an operator passes to vLLM for ``role`` on ``platform``.

    The Attention role runs vLLM's stock worker with an ``AFD<arch>`` model;
    the FFN role is served by afd-sdk's standalone FFN server (``afd ffn serve``),
    which needs no vLLM worker. NPU workers come from vllm-ascend.
    """
    if role not in ("attention", "ffn"):
        raise AFDConfigError(f"role={role!r} is invalid; expected 'attention' or 'ffn'", key="afd.role", value=role)
    if role == "ffn":
        return {"ffn_server": "afd_sdk.runtime.ffn_server:FFNServer", "command": "afd ffn serve"}
    if platform == "npu":
        return {"worker_cls": "vllm_ascend.worker.worker_v1.NPUWorker"}
    if platform not in _WORKERS:
        raise AFDConfigError(f"platform={platform!r} is invalid; expected one of cuda, cpu, npu", key="platform",
                             value=platform)  # fmt: skip
    return {"worker_cls": _WORKERS[platform]}


# --- metadata provider ---------------------------------------------------------------


class VllmMetadataProvider(MetadataProvider):
    """Forward metadata at ``ForwardContext.additional_kwargs["afd_metadata"]``.

    ``install`` sets it on the current forward context (if one is set) and, for
    the scope, wraps ``vllm.forward_context.create_forward_context`` so contexts
    created inside it (dummy runs, graph capture) carry it too; both are
    restored in ``finally``, also when the body raises, and installs nest.
    vLLM's forward context is per process, so this provider follows it (vLLM's
    own ubatch threads switch contexts with ``override_forward_context``).
    """

    name = "vllm"

    def __init__(self) -> None:
        self._fc: Any = None

    def _module(self) -> Any:
        if self._fc is None:
            import vllm.forward_context as fc

            self._fc = fc
        return self._fc

    @contextlib.contextmanager
    def install(self, metadata: ForwardMetadata) -> Iterator[ForwardMetadata]:
        fc = self._module()
        original = fc.create_forward_context

        def create_forward_context(*args: Any, **kwargs: Any) -> Any:
            ctx = original(*args, **kwargs)
            ctx.additional_kwargs[METADATA_KEY] = metadata
            return ctx

        ctx = fc.get_forward_context() if fc.is_forward_context_available() else None
        previous = _MISSING if ctx is None else ctx.additional_kwargs.get(METADATA_KEY, _MISSING)
        fc.create_forward_context = create_forward_context
        if ctx is not None:
            ctx.additional_kwargs[METADATA_KEY] = metadata
        try:
            yield metadata
        finally:
            fc.create_forward_context = original
            if ctx is not None:
                if previous is _MISSING:
                    ctx.additional_kwargs.pop(METADATA_KEY, None)
                else:
                    ctx.additional_kwargs[METADATA_KEY] = previous

    def current(self) -> ForwardMetadata | None:
        fc = self._module()
        if not fc.is_forward_context_available():
            return None
        return fc.get_forward_context().additional_kwargs.get(METADATA_KEY)


# --- AFD alias model classes -----------------------------------------------------------


def lazy_alias_classes(module: str, natives: dict[str, str], adapter_cls: type[ModelAdapter]) -> Any:
    """A module ``__getattr__`` that builds ``AFD<arch>`` classes on first access.

    ``natives`` maps architecture -> vLLM module holding its native class.
    vLLM's registry imports ``module`` and reads ``AFD<arch>``; only that
    architecture's native module is imported, and the class pickles by
    reference (its ``__module__`` is ``module``).
    """
    import importlib
    import sys

    def __getattr__(name: str) -> type:
        arch = name.removeprefix("AFD")
        if not name.startswith("AFD") or arch not in natives:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        native = getattr(importlib.import_module(natives[arch]), arch)
        cls = afd_model_class(native, arch, adapter_cls, module=module)
        setattr(sys.modules[module], name, cls)
        return cls

    return __getattr__


def afd_model_class(
    native: type,
    architecture: str,
    adapter_cls: type[ModelAdapter],
    *,
    module: str | None = None,
    layers_path: str = "model.layers",
    ffn_attr: str = "mlp",
) -> type:
    """Subclass vLLM's ``native`` model class as ``AFD<architecture>`` with a role filter in ``load_weights``.

    The role comes from ``vllm_config.additional_config["afd"]``; selecting an
    AFD alias without an ``afd`` config is an ``AFDConfigError``. On the
    Attention role with the gate on FFN, each decoder layer's FFN module
    (``<layers_path>[i].<ffn_attr>``) is replaced by the same
    :class:`~afd_sdk.proxy.RemoteFFN` proxy the transformers binding places,
    reading its metadata from vLLM's ``ForwardContext``. ``load_weights``
    passes on only the tensors the role loads and raises
    ``UnclassifiedWeightError`` for a name no rule covers.
    """

    def __init__(self: Any, *, vllm_config: Any, prefix: str = "") -> None:
        cfg = afd_config_from_vllm(vllm_config)
        if cfg is None:
            raise AFDConfigError(
                f'{afd_alias(architecture)} needs --additional-config \'{{"afd": {{"role": ...}}}}\'; '
                f"use {architecture} for a non-AFD deployment",
                key="afd",
            )
        hf_config = vllm_config.model_config.hf_config
        self.afd_config = cfg
        self.afd_adapter = adapter_cls(architecture, hf_config.to_dict())
        native.__init__(self, vllm_config=vllm_config, prefix=prefix)
        if cfg.role == "attention" and not cfg.compute_gate_on_attention:
            from afd_sdk.proxy import module_at, place_remote_ffn

            layers = module_at(self, layers_path)
            place_remote_ffn(layers, ffn_attr, VllmMetadataProvider(), self.afd_adapter.ffn_extras())

    def load_weights(self: Any, weights: Iterable[tuple[str, Any]]) -> Any:
        return native.load_weights(self, afd_filter_weights(self.afd_adapter, self.afd_config, weights))

    name = afd_alias(architecture)
    attrs = {"__init__": __init__, "load_weights": load_weights, "__qualname__": name, "afd_architecture": architecture,
             "__module__": module or native.__module__}  # fmt: skip
    return type(name, (native,), attrs)


def afd_filter_weights(
    adapter: ModelAdapter, config: AFDConfig, weights: Iterable[tuple[str, Any]]
) -> Iterator[tuple[str, Any]]:
    """Yield only the ``(name, tensor)`` pairs ``config.role`` loads; unclassified names raise."""
    from afd_sdk.errors import UnclassifiedWeightError

    role, gate = config.role, config.compute_gate_on_attention
    for name, tensor in weights:
        r = adapter.weight_role(name, compute_gate_on_attention=gate)
        if r is None:
            raise UnclassifiedWeightError(adapter.architecture, [name])
        if r.loaded_by(role):
            yield name, tensor
