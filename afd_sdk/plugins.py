"""The plugin manager: built-ins first, then installed distributions.

Load order: :data:`DEFAULT_PLUGINS` (built-in modules, registered through the
same hooks as anyone else), then every entry point in group ``afd_sdk`` that
the environment allows, then ``check_pending()``. A plugin that fails to
import, declares a hook that does not exist, or whose hook raises is recorded
and skipped; the others keep working, and asking for one of the failed
plugin's components raises ``PluginLoadError`` carrying the original failure.

Environment:

* ``AFD_PLUGINS`` — comma list of external plugin (entry-point) names to load.
  Unset: all. Empty: none.
* ``AFD_DISABLE_PLUGINS`` — comma list of plugin names not to load (built-ins
  included).
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy

from afd_sdk.adapter import ModelAdapter
from afd_sdk.config import AFDConfig
from afd_sdk.connector import ConnectorBase
from afd_sdk.errors import AFDConfigError, AFDError, PluginLoadError, RegistrationError
from afd_sdk.hookspecs import PROJECT, AFDHookSpecs
from afd_sdk.metadata import MetadataProvider
from afd_sdk.registry import Provenance, Registry
from afd_sdk.weights import read_hf_config

__all__ = [
    "DEFAULT_PLUGINS",
    "ENTRY_POINT_GROUP",
    "AFDPluginManager",
    "PluginRecord",
    "ResolvedConfig",
    "adapter_class",
    "adapter_for",
    "get_plugin_manager",
    "reset_plugin_manager",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "afd_sdk"
#: Built-in plugin modules, loaded first, through the public hooks.
DEFAULT_PLUGINS: tuple[str, ...] = ("afd_sdk.default_plugin", "afd_connectors.plugin")

_REGISTER_HOOKS = {
    "connectors": "afd_register_connectors",
    "model_adapters": "afd_register_model_adapters",
    "metadata_providers": "afd_register_metadata_providers",
}


@dataclass
class PluginRecord:
    """One plugin as ``afd plugins`` shows it."""

    name: str
    kind: str  # "builtin" | "entrypoint" | "in-process"
    distribution: str | None = None
    version: str | None = None
    status: str = "loaded"  # "loaded" | "failed" | "skipped"
    error: str | None = None
    reason: str | None = None  # why skipped
    registered: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in _REGISTER_HOOKS})
    failure: PluginLoadError | None = field(default=None, repr=False)
    #: True when the failure came from a register hook (retried on re-collect)
    failed_in_hooks: bool = False

    @property
    def provenance(self) -> Provenance:
        return Provenance(self.name, self.distribution, self.version)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "error": self.error,
            "reason": self.reason,
            "registered": self.registered,
        }


@dataclass(frozen=True)
class ResolvedConfig:
    """A config whose connector was resolved and whose extra config was parsed."""

    config: AFDConfig
    connector_cls: type[ConnectorBase]
    extra_config: Any


def _env_list(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def _own_version() -> str:
    try:
        return md.version("afd-sdk")
    except md.PackageNotFoundError:  # running from a source tree without install
        from afd_sdk.version import __version__

        return __version__


class AFDPluginManager:
    """Owns the pluggy manager and the three registries."""

    def __init__(self, *, load_entrypoints: bool = True, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self._allow = _env_list(env.get("AFD_PLUGINS"))
        self._block = _env_list(env.get("AFD_DISABLE_PLUGINS")) or set()
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(AFDHookSpecs)
        self.records: dict[str, PluginRecord] = {}
        self._lock = threading.RLock()
        own_version = _own_version()
        for module_name in DEFAULT_PLUGINS:
            record = PluginRecord(module_name, "builtin", "afd-sdk", own_version)
            self._load(module_name, record, lambda m=module_name: importlib.import_module(m))
        if load_entrypoints:
            self._load_entrypoints()
        self._pm.check_pending()
        self._collect()

    # --- loading ------------------------------------------------------------

    def _load_entrypoints(self) -> None:
        seen: dict[str, str | None] = {}
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist is not None else None
            version = ep.dist.version if ep.dist is not None else None
            record = PluginRecord(ep.name, "entrypoint", dist, version)
            if ep.name in seen:
                if seen[ep.name] == dist:
                    continue  # same distribution visible twice on sys.path
                record.status = "failed"
                record.error = f"entry-point name {ep.name!r} is also used by distribution {seen[ep.name]!r}"
                self.records[f"{ep.name} ({dist})"] = record
                continue
            seen[ep.name] = dist
            if self._allow is not None and ep.name not in self._allow:
                record.status, record.reason = "skipped", "not in AFD_PLUGINS"
                self.records[ep.name] = record
                continue
            self._load(ep.name, record, ep.load)

    def _load(self, name: str, record: PluginRecord, loader: Callable[[], object]) -> None:
        if name in self._block:
            record.status, record.reason = "skipped", "in AFD_DISABLE_PLUGINS"
            self.records[name] = record
            return
        self.records[name] = record
        try:
            plugin = loader()
        except Exception as exc:  # recorded, shown by `afd plugins`, re-raised on use
            self._fail(record, f"import failed: {exc!r}", exc)
            return
        self._register_object(plugin, record)

    def _register_object(self, plugin: object, record: PluginRecord) -> None:
        try:
            self._pm.register(plugin, name=record.name)
        except Exception as exc:  # pluggy.PluginValidationError, ValueError for duplicates
            self._fail(record, f"invalid plugin: {exc}", exc)
            return
        unknown = [
            caller.name
            for caller in (self._pm.get_hookcallers(plugin) or [])
            if not caller.has_spec() and not caller.name.startswith("_")
        ]
        if unknown:
            self._pm.unregister(plugin)
            exc = PluginLoadError(f"plugin {record.name!r} implements unknown hook(s) {unknown}")
            self._fail(record, str(exc), exc)

    def _fail(self, record: PluginRecord, message: str, exc: BaseException) -> None:
        record.status = "failed"
        record.error = message
        record.failure = PluginLoadError(
            f"{record.provenance} failed: {message}",
            plugin=record.name,
            distribution=record.distribution,
            version=record.version,
            cause=exc,
        )
        logger.warning("afd-sdk %s", record.failure)

    # --- registries ---------------------------------------------------------

    def _collect(self) -> None:
        """(Re)build the registries by calling each plugin's register hooks in load order."""
        self.connectors: Registry[ConnectorBase] = Registry(
            "connector",
            ConnectorBase,
            expected="a subclass of afd_sdk.connector.AFDConnector or afd_sdk.dispatch.AsyncDispatchConnector",
        )
        self.model_adapters: Registry[ModelAdapter] = Registry("model adapter", ModelAdapter)
        self.metadata_providers: Registry[MetadataProvider] = Registry("metadata provider", MetadataProvider)
        registries = {
            "connectors": self.connectors,
            "model_adapters": self.model_adapters,
            "metadata_providers": self.metadata_providers,
        }
        for record in self.records.values():
            if record.failed_in_hooks:  # registries are rebuilt from scratch: give its hooks another run
                record.status, record.error, record.failure, record.failed_in_hooks = "loaded", None, None, False
            if record.status != "loaded":
                continue
            record.registered = {k: [] for k in _REGISTER_HOOKS}
            for kind, hook_name in _REGISTER_HOOKS.items():
                registry = registries[kind]
                hook = getattr(self._pm.hook, hook_name)
                for impl in hook.get_hookimpls():
                    if impl.plugin_name != record.name:
                        continue

                    def register(
                        name: str,
                        target: object,
                        *,
                        aliases: tuple[str, ...] = (),
                        _reg: Registry[Any] = registry,
                        _kind: str = kind,
                        _record: PluginRecord = record,
                    ) -> None:
                        _reg.register(name, target, aliases=tuple(aliases), provenance=_record.provenance)
                        _record.registered[_kind].append(name)

                    try:
                        impl.function(register=register)
                    except Exception as exc:  # a broken plugin must not stop the others
                        self._fail(record, f"{hook_name} raised {exc!r}", exc)
                        record.failed_in_hooks = True
                        break
                if record.status == "failed":
                    break
        for record in self.records.values():
            if record.failure is not None:
                for registry in registries.values():
                    registry.mark_failed(record.name, record.failure)
                    registry.plugin_failures.append(record.failure)

    # --- in-process plugins (tests, notebooks) -------------------------------

    def register_plugin(self, plugin: object | ModuleType, name: str) -> PluginRecord:
        """Register a plugin object in-process (tests); registries are rebuilt."""
        with self._lock:
            if name in self.records:
                raise RegistrationError(f"plugin name {name!r} is already used by {self.records[name].provenance}")
            record = PluginRecord(name, "in-process")
            self.records[name] = record
            self._register_object(plugin, record)
            self._collect()
            return record

    def unregister_plugin(self, name: str) -> None:
        """Remove a plugin (any kind) and rebuild the registries."""
        with self._lock:
            if name not in self.records:
                raise AFDConfigError(
                    f"plugin {name!r} is not loaded; loaded: {', '.join(self.records)}", key="plugin", value=name
                )
            del self.records[name]
            if self._pm.get_plugin(name) is not None:
                self._pm.unregister(name=name)
            self._collect()

    # --- what callers use -----------------------------------------------------

    def failures(self) -> list[PluginRecord]:
        return [r for r in self.records.values() if r.status == "failed"]

    def connector_class(self, name: str) -> type[ConnectorBase]:
        return self.connectors.resolve(name)

    def adapter_class(self, architecture: str) -> type[ModelAdapter]:
        return self.model_adapters.resolve(architecture)

    def metadata_provider(self, name: str = "contextvar") -> MetadataProvider:
        return self.metadata_providers.resolve(name)()

    def resolve_config(self, config: AFDConfig) -> ResolvedConfig:
        """Resolve the connector, parse its extra config, run every plugin's veto.

        Everything here happens before any resource exists.
        """
        cls = self.connector_class(config.connector)
        extra = cls.parse_extra_config(config.connector_extra_config)
        if config.ffn_replicas > 1 and cls.capabilities.async_dispatch:
            raise AFDConfigError(
                f"afd.ffn_replicas={config.ffn_replicas} is not supported by {cls.name or cls.__name__}, a "
                "routed-dispatch connector, whose FFN ranks are not interchangeable; expected 1 (CAM places each "
                "expert on several FFN ranks instead: connector_extra_config.expert_replicas), or a point-to-point "
                "connector",
                key="afd.ffn_replicas",
                value=config.ffn_replicas,
            )
        cls.validate_config(config)
        for impl in self._pm.hook.afd_validate_config.get_hookimpls():
            try:
                impl.function(config=config)
            except AFDError:
                raise
            except Exception as exc:
                raise AFDConfigError(
                    f"plugin {impl.plugin_name!r} failed while validating the config: {exc!r}", key="afd"
                ) from exc
        return ResolvedConfig(config, cls, extra)

    def as_dict(self) -> dict[str, Any]:
        return {
            "plugins": [r.as_dict() for r in self.records.values()],
            "connectors": [
                {
                    "name": e.name,
                    "aliases": list(e.aliases),
                    "target": e.target_repr,
                    "plugin": e.provenance.plugin,
                    "distribution": e.provenance.distribution,
                }
                for e in self.connectors.entries()
            ],
            "model_adapters": [
                {
                    "architecture": e.name,
                    "target": e.target_repr,
                    "plugin": e.provenance.plugin,
                    "distribution": e.provenance.distribution,
                }
                for e in self.model_adapters.entries()
            ],
            "metadata_providers": [
                {"name": e.name, "target": e.target_repr, "plugin": e.provenance.plugin}
                for e in self.metadata_providers.entries()
            ],
        }


_manager: AFDPluginManager | None = None
_manager_lock = threading.Lock()


def get_plugin_manager() -> AFDPluginManager:
    """The process-wide manager, loaded on first use (thread-safe)."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = AFDPluginManager()
        return _manager


def reset_plugin_manager() -> None:
    """Forget the process-wide manager so the next call reloads (tests, after env changes)."""
    global _manager
    with _manager_lock:
        _manager = None


def adapter_class(architecture: str) -> type[ModelAdapter]:
    """The model-adapter class an installed plugin registered for ``architecture``.

    ``architecture`` is a checkpoint architecture name (``MixtralForCausalLM``;
    the AFD alias ``AFDMixtralForCausalLM`` is accepted too). Raises
    ``UnknownNameError`` listing the registered architectures.
    """
    return get_plugin_manager().adapter_class(architecture.removeprefix("AFD"))


def adapter_for(config: Mapping[str, Any] | str | Path) -> ModelAdapter:
    """The model adapter of a checkpoint: its ``config.json`` as a mapping, or its path or directory.

    Reads ``architectures[0]`` and instantiates the registered adapter with
    the config (what the runtimes do at start-up). Raises ``AFDConfigError``
    when the config names no architecture.
    """
    hf_config = dict(config) if isinstance(config, Mapping) else read_hf_config(config)
    source = "config" if isinstance(config, Mapping) else str(config)
    archs = hf_config.get("architectures") or []
    if not archs:
        raise AFDConfigError(
            f"{source!r} has no 'architectures'; expected e.g. ['MixtralForCausalLM']", key="architectures"
        )
    architecture = str(archs[0]).removeprefix("AFD")
    return adapter_class(architecture)(architecture, hf_config)
