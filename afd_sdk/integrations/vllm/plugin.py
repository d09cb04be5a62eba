"""The ``vllm.general_plugins`` entry point and the ``additional_config["afd"]`` channel.

vLLM calls :func:`register` in every process that loads its plugins
(``vllm.plugins.load_general_plugins``). Nothing here imports vLLM at module
import time; without vLLM, :func:`register` does nothing.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from afd_sdk.adapter import ModelAdapter, afd_alias
from afd_sdk.config import AFDConfig, parse_config
from afd_sdk.errors import AFDConfigError, PluginLoadError

__all__ = ["afd_config_from_vllm", "register", "register_model_aliases", "worker_classes"]

logger = logging.getLogger(__name__)

_registered = False
_register_lock = threading.Lock()


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
        logger.warning(
            "afd-sdk plugin %s (%s) failed to load; its models get no vLLM alias: %s",
            failed.name,
            failed.distribution or "no distribution",
            failed.error,
        )
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
    the FFN role is served on vLLM's own FFN modules by ``afd ffn serve
    --engine vllm`` (:mod:`afd_sdk.integrations.vllm.ffn`), which needs no
    vLLM worker, scheduler or KV cache. NPU workers come from vllm-ascend.
    """
    if role not in ("attention", "ffn"):
        raise AFDConfigError(f"role={role!r} is invalid; expected 'attention' or 'ffn'", key="afd.role", value=role)
    if role == "ffn":
        return {"ffn_server": "afd_sdk.integrations.vllm.ffn:open_ffn_role", "command": "afd ffn serve --engine vllm"}
    if platform == "npu":
        return {"worker_cls": "vllm_ascend.worker.worker_v1.NPUWorker"}
    if platform not in _WORKERS:
        raise AFDConfigError(
            f"platform={platform!r} is invalid; expected one of cuda, cpu, npu", key="platform", value=platform
        )
    return {"worker_cls": _WORKERS[platform]}
