"""The built-in connectors' optional native modules: one loader, one status table.

Two kinds ship in the sources (``setup.py`` builds them):

* C modules (``zmq._zmqwire``, ``shm._shmring``): plain CPython extensions, built by every ``pip install`` on
  Linux with a C compiler;
* torch extensions (``p2p._p2pwire``, ``zmq._zmqsteady``, ``shm._shmsteady``): C++ against libtorch, so each must
  run with the very torch it was compiled against. ``pip`` builds them only where torch is importable at build
  time (``pip install --no-build-isolation``); an isolated ``pip install afd-sdk`` has no torch to compile against
  and ships without them.

Every module is optional: without it the connector runs the same data path in Python. :func:`load` imports one
or says why it cannot. For a torch extension it first compares the torch it was built against (the build record
``setup.py`` writes beside the modules, ``_torch_build.json``) with the torch imported here, and refuses a
mismatch with a message instead of loading a library whose C++ ABI may differ: a mismatched libtorch fails with
an undefined symbol at best and crashes at worst. :func:`status` is the table ``afd plugins --json`` shows.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["BUILD_RECORD", "MODULES", "load", "problems", "status", "torch_mismatch"]

#: the build record's file name, beside this module (written by setup.py's build_ext)
BUILD_RECORD = "_torch_build.json"

#: native module (under ``afd_connectors``) -> (kind, what runs without it)
MODULES: dict[str, tuple[str, str]] = {
    "zmq._zmqwire": ("c", "ZmqAFDConnector moves messages through pyzmq (wire_name 'pyzmq')"),
    "zmq._zmqsteady": ("torch", "ZmqAFDConnector runs its steady state in Python"),
    "shm._shmring": ("c", "ShmAFDConnector is unavailable (config validation names this module)"),
    "shm._shmsteady": ("torch", "ShmAFDConnector runs its steady state in Python"),
    "p2p._p2pwire": ("torch", "P2pNcclAFDConnector makes its process-group calls from Python (wire_name 'python')"),
}

_REBUILD = "rebuild it next to this torch: pip install --no-build-isolation --force-reinstall --no-deps afd-sdk"


def _build_record() -> dict[str, Any] | None:
    path = Path(__file__).with_name(BUILD_RECORD)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # unreadable: vouches for nothing
        return {"unreadable": f"{path} cannot be read ({exc})"}
    return record if isinstance(record, dict) else {"unreadable": f"{path} holds no JSON object"}


def torch_mismatch(record: dict[str, Any] | None, module: str | None = None) -> str | None:
    """Why the torch extension ``module`` (``afd_connectors.<name>``; ``None``: any) built as ``record`` says
    cannot load against the torch imported here, or ``None``."""
    import torch

    if record is None:
        return (
            "not built: this afd-sdk was built without torch to compile against (an isolated pip build); "
            "pip install --no-build-isolation --force-reinstall --no-deps afd-sdk next to torch builds it"
        )
    if "unreadable" in record:
        return f"its build record is unusable: {record['unreadable']}; {_REBUILD}"
    if module is not None and module not in record.get("extensions", ()):
        return f"the build did not produce it (its build record lists {record.get('extensions', [])}); {_REBUILD}"
    here = {"torch": torch.__version__, "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI)}
    built = {k: record.get(k) for k in here}
    if built != here:
        return (
            f"built against torch {built['torch']} (cxx11_abi={built['cxx11_abi']}), "
            f"this is torch {here['torch']} (cxx11_abi={here['cxx11_abi']}); {_REBUILD}"
        )
    return None


def load(name: str) -> tuple[ModuleType | None, str | None]:
    """Import ``afd_connectors.<name>``: ``(module, None)``, or ``(None, why not)``.

    Called once per connector module at import time, never on a data path. ``name`` must be a key of
    :data:`MODULES`. A torch extension is imported after ``torch`` (it links libtorch without an rpath) and only
    when the build record matches this torch.
    """
    kind, _ = MODULES[name]
    full = f"afd_connectors.{name}"
    if kind == "torch":
        import torch  # noqa: F401  (loads libc10/libtorch first)

        problem = torch_mismatch(_build_record(), full)
        if problem is not None:
            return None, f"{full} not loaded: {problem}"
    try:
        return importlib.import_module(full), None
    except ImportError as exc:  # not built: no compiler at install, not Linux, or an isolated build (torch)
        return None, f"{full} does not import ({exc})"


def problems(*names: str) -> dict[str, str | None]:
    """``{"afd_connectors.<name>": None or why it does not load}``: a connector's ``native_modules()``."""
    return {f"afd_connectors.{name}": load(name)[1] for name in names}


def status() -> dict[str, dict[str, Any]]:
    """Every native module: ``{"kind", "loaded", "problem", "fallback"}``, for ``afd plugins --json``."""
    out: dict[str, dict[str, Any]] = {}
    for name, (kind, fallback) in MODULES.items():
        module, problem = load(name)
        out[f"afd_connectors.{name}"] = {
            "kind": kind,
            "loaded": module is not None,
            "problem": problem,
            "fallback": None if module is not None else fallback,
        }
    return out
