"""Name -> lazy target registries with ABC checks and provenance.

One :class:`Registry` per component kind. Targets are classes or
``"module:attr"`` strings resolved (and ABC-checked) on first use; the result
is cached, so the hot path never looks anything up twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from afd_sdk.adapter import resolve_target
from afd_sdk.config import did_you_mean
from afd_sdk.errors import PluginLoadError, PluginTargetError, RegistrationError, UnknownNameError

__all__ = ["Provenance", "Registry", "RegistryEntry"]

T = TypeVar("T")


@dataclass(frozen=True)
class Provenance:
    """Which plugin registered something, from which distribution."""

    plugin: str
    distribution: str | None = None
    version: str | None = None

    def __str__(self) -> str:
        dist = f" ({self.distribution} {self.version})" if self.distribution else " (in-process)"
        return f"plugin {self.plugin!r}{dist}"


@dataclass
class RegistryEntry:
    name: str
    target: object
    aliases: tuple[str, ...]
    provenance: Provenance
    #: set when the registering plugin later failed; resolving re-raises it
    failure: PluginLoadError | None = None

    @property
    def target_repr(self) -> str:
        t = self.target
        return t if isinstance(t, str) else f"{t.__module__}:{t.__qualname__}"  # type: ignore[attr-defined]


class Registry(Generic[T]):
    """Registry of one component kind, e.g. ``Registry("connector", AFDConnector)``."""

    def __init__(self, kind: str, base: type[T], *, expected: str | None = None) -> None:
        self.kind = kind
        self.base = base
        #: what a target must be, as the error says it (default: the base class's dotted name)
        self.expected = expected or f"a subclass of {base.__module__}.{base.__qualname__}"
        self._entries: dict[str, RegistryEntry] = {}
        self._aliases: dict[str, str] = {}
        self._resolved: dict[str, type[T]] = {}
        #: plugin failures to mention when a name is unknown (it may have been theirs)
        self.plugin_failures: list[PluginLoadError] = []

    # --- registration -------------------------------------------------------

    def register(self, name: str, target: object, *, aliases: tuple[str, ...] = (), provenance: Provenance) -> None:
        if not isinstance(name, str) or not name:
            raise RegistrationError(
                f"{provenance} registered a {self.kind} with name={name!r}; expected a non-empty str"
            )
        if not (isinstance(target, str) or isinstance(target, type)):
            raise RegistrationError(
                f"{provenance} registered {self.kind} {name!r} with target={target!r}; "
                "expected a class or a 'module:attr' string"
            )
        aliases = tuple(aliases)
        for key in (name, *aliases):
            holder = self._owner(key)
            if holder is not None:
                what = "name" if key == holder.name else "alias"
                raise RegistrationError(
                    f"{self.kind} {key!r} from {provenance} clashes with the {what} {key!r} of "
                    f"{self.kind} {holder.name!r} from {holder.provenance}"
                )
        if len(set((name, *aliases))) != len(aliases) + 1:
            raise RegistrationError(f"{provenance} registered {self.kind} {name!r} with repeated aliases {aliases!r}")
        self._entries[name] = RegistryEntry(name, target, aliases, provenance)
        for alias in aliases:
            self._aliases[alias] = name

    def _owner(self, key: str) -> RegistryEntry | None:
        if key in self._entries:
            return self._entries[key]
        if key in self._aliases:
            return self._entries[self._aliases[key]]
        return None

    def mark_failed(self, plugin: str, failure: PluginLoadError) -> None:
        """Entries of ``plugin`` stay listed but resolving them raises ``failure``."""
        for entry in self._entries.values():
            if entry.provenance.plugin == plugin:
                entry.failure = failure

    def remove_plugin(self, plugin: str) -> None:
        for name in [n for n, e in self._entries.items() if e.provenance.plugin == plugin]:
            entry = self._entries.pop(name)
            for alias in entry.aliases:
                self._aliases.pop(alias, None)
            self._resolved.pop(name, None)

    # --- lookup -------------------------------------------------------------

    def canonical(self, name: str) -> str:
        """Canonical name for ``name`` or an alias; unknown names raise ``UnknownNameError``."""
        if name in self._entries:
            return name
        if name in self._aliases:
            return self._aliases[name]
        known = sorted([*self._entries, *self._aliases])
        msg = f"{self.kind} {name!r} is not registered{did_you_mean(name, known)} (known: {', '.join(known) or 'none'})"
        if self.plugin_failures:
            msg += "; plugins that failed to load and may have provided it: " + "; ".join(
                f"{f.plugin} ({f.distribution or 'in-process'}): {f.cause!r}" for f in self.plugin_failures
            )
        raise UnknownNameError(msg, key=self.kind, value=name)

    def entry(self, name: str) -> RegistryEntry:
        return self._entries[self.canonical(name)]

    def resolve(self, name: str) -> type[T]:
        """The class registered under ``name`` or an alias, imported and ABC-checked once."""
        canonical = self.canonical(name)
        cached = self._resolved.get(canonical)
        if cached is not None:
            return cached
        entry = self._entries[canonical]
        if entry.failure is not None:
            raise PluginLoadError(
                f"{self.kind} {canonical!r} is unavailable: {entry.provenance} failed to load: {entry.failure.cause!r}",
                plugin=entry.provenance.plugin,
                distribution=entry.provenance.distribution,
                version=entry.provenance.version,
                cause=entry.failure.cause,
            )
        target = entry.target
        if isinstance(target, str):
            try:
                target = resolve_target(target, what=f"{self.kind} {canonical!r} from {entry.provenance}")
            except PluginLoadError as exc:
                exc.plugin = entry.provenance.plugin
                exc.distribution = entry.provenance.distribution
                exc.version = entry.provenance.version
                raise
        if not (isinstance(target, type) and issubclass(target, self.base)):
            raise PluginTargetError(
                f"{self.kind} {canonical!r} from {entry.provenance} resolves to {entry.target_repr} = {target!r}, "
                f"which is not {self.expected}"
            )
        self._resolved[canonical] = target
        return target

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[RegistryEntry]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._entries or name in self._aliases)

    def __len__(self) -> int:
        return len(self._entries)
