"""Deprecated import paths: every public module or name that moved keeps working, with a warning, for at least
one minor release (``docs/api.md`` lists them with the release that removes them; ``CHANGELOG.md`` says when
each moved).

Moved modules are served by one import hook (:class:`MovedModuleFinder`, installed by ``import afd_sdk``): the old
module name imports as an alias module whose attributes are the new modules' (the very same objects, so
``isinstance`` works and a class patched in place is patched for both), after a ``DeprecationWarning`` that names
the new place. The alias copies the names once, at its import: rebinding a name (``monkeypatch.setattr``) through
the old path patches only the alias, and a name rebound in the new module later is not seen through the old one.
Moved names inside a module that still exists go through :func:`moved_names` (a module ``__getattr__``). Nothing
here runs on a data path: an alias costs one warning at import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

__all__ = ["MOVED_MODULES", "REMOVED_IN", "MovedModuleFinder", "install", "moved_names", "warn_moved"]

#: the release that drops every alias below
REMOVED_IN = "0.4.0"

#: old module -> the module(s) its public names live in now (first match wins for a name in several)
MOVED_MODULES: dict[str, tuple[str, ...]] = {
    # 0.1.0: the transport kit moved from the built-in connectors into afd_sdk.control
    "afd_connectors.zmq_control": ("afd_sdk.control.plane",),
    "afd_connectors.frames": ("afd_sdk.control.framing", "afd_sdk.control.buffers"),
    "afd_connectors.zmq_endpoint": ("afd_sdk.control.endpoint",),
    "afd_connectors.process_groups": ("afd_sdk.control.process_groups",),
    # 0.1.0: the transformers binding became an integration; the cut its proxies make moved to afd_sdk.proxy
    "afd_sdk.hf": ("afd_sdk.integrations.transformers", "afd_sdk.proxy"),
    "afd_sdk.testing.harness": ("afd_sdk.runtime.world",),
    "afd_sdk.testing.models": ("afd_sdk.checkpoints",),
    # 0.2.0: one subpackage per built-in transport
    "afd_connectors.zmq_connector": ("afd_connectors.zmq.connector",),
    "afd_connectors.zmq_raw": ("afd_connectors.zmq.raw",),
    "afd_connectors.zmq_wire": ("afd_connectors.zmq.wire",),
    "afd_connectors.p2p_connector": ("afd_connectors.p2p.connector",),
    "afd_connectors.p2p_raw": ("afd_connectors.p2p.raw",),
    "afd_connectors.p2p_wire": ("afd_connectors.p2p.wire",),
    "afd_connectors.shm_connector": ("afd_connectors.shm.connector",),
    "afd_connectors.shm_raw": ("afd_connectors.shm.raw",),
    "afd_connectors.shm_spin": ("afd_connectors.shm.spin",),
    "afd_connectors.cam_connector": ("afd_connectors.cam.connector",),
    "afd_connectors.cam_backend": ("afd_connectors.cam.backend",),
    "afd_connectors.cam_portable": ("afd_connectors.cam.portable",),
    "afd_connectors.cam_ascend": ("afd_connectors.cam.ascend",),
    "afd_connectors.cam_rendezvous": ("afd_connectors.cam.rendezvous",),
}


def _bootstrap(filename: str) -> bool:
    """The frames ``warnings`` itself skips when it counts a stacklevel (frozen or not)."""
    return "importlib" in filename and "_bootstrap" in filename


def _internal(filename: str) -> bool:
    return (
        filename == __file__
        or _bootstrap(filename)
        or filename.endswith(("importlib/__init__.py", "importlib\\__init__.py"))
    )


def _caller_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, as called from :func:`warn_moved`, of the first frame outside this module
    and the import machinery: the line that imported or looked up the old name. ``warnings`` itself skips
    importlib's bootstrap frames when it counts, so they are not counted here either."""
    frame = sys._getframe(1)  # warn_moved: stacklevel 1
    level = 1
    while frame.f_back is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
        if not _bootstrap(frame.f_code.co_filename):
            level += 1
    return level


def warn_moved(old: str, new: str) -> None:
    """Emit the one ``DeprecationWarning`` every alias gives: old place, new place, the release that removes it."""
    warnings.warn(
        f"{old} is deprecated and will be removed in afd-sdk {REMOVED_IN}; import it from {new}",
        DeprecationWarning,
        stacklevel=_caller_stacklevel(),
    )


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, targets: tuple[str, ...]) -> None:
        self._targets = targets

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a fresh module object: the targets' own __spec__ and __name__ stay theirs

    def exec_module(self, module: ModuleType) -> None:
        warn_moved(module.__name__, " / ".join(self._targets))
        targets = [importlib.import_module(t) for t in self._targets]
        for target in reversed(targets):  # the first target wins a name two of them define
            module.__dict__.update({k: v for k, v in vars(target).items() if not k.startswith("__")})
        module.__doc__ = f"Deprecated alias of {', '.join(self._targets)} (removed in afd-sdk {REMOVED_IN})."

        def __getattr__(name: str) -> Any:  # names a target defines later, or lazily
            for target in targets:
                if hasattr(target, name):
                    return getattr(target, name)
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

        module.__getattr__ = __getattr__  # type: ignore[method-assign]


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Serves the old names in :data:`MOVED_MODULES` as alias modules (see the module docstring)."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        targets = MOVED_MODULES.get(fullname)
        if targets is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(targets))


def install() -> None:
    """Put :class:`MovedModuleFinder` on ``sys.meta_path`` once (``import afd_sdk`` calls it)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())


def moved_names(module: str, moved: Mapping[str, str | tuple[str, Callable[[], Any]]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for names that left ``module``.

    ``moved`` maps an old name to ``"new.module:name"`` (the same object, re-exported) or to ``(new place,
    factory)`` where the old object cannot simply be re-exported (e.g. the return shape changed): ``factory()``
    builds a compatible one. Either way the lookup warns once per access, naming the new place.
    """

    def __getattr__(name: str) -> Any:
        where = moved.get(name)
        if where is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if isinstance(where, tuple):
            new_place, factory = where
            warn_moved(f"{module}.{name}", new_place)
            return factory()
        new_module, _, new_name = where.partition(":")
        warn_moved(f"{module}.{name}", new_module if new_name == name else f"{new_module} (as {new_name})")
        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__
