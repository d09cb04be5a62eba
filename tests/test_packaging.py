"""The install surface from the source tree: deprecated import paths, the torch-extension guard, the version."""

from __future__ import annotations

import importlib
import sys
import types
import warnings

import pytest

import afd_sdk
from afd_sdk._compat import MOVED_MODULES, REMOVED_IN


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_moved_module_imports_with_a_warning_naming_the_new_place(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated and will be removed in afd-sdk {REMOVED_IN}"):
        alias = importlib.import_module(old)
    targets = [importlib.import_module(t) for t in MOVED_MODULES[old]]
    public = [n for t in targets for n in getattr(t, "__all__", ()) or [k for k in vars(t) if not k.startswith("_")]]
    assert public, f"{old}'s targets export nothing"
    for name in public:  # the very same objects: isinstance and monkeypatching keep working
        owner = next(t for t in targets if hasattr(t, name))
        assert getattr(alias, name) is getattr(owner, name), (old, name)


def test_the_warning_points_at_the_importing_line():
    sys.modules.pop("afd_connectors.zmq_control", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from afd_connectors.zmq_control import ZmqControlPlane  # noqa: F401
    (w,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert w.filename == __file__ and "afd_sdk.control.plane" in str(w.message)


def test_previous_documented_imports_still_resolve():
    """What the 0.1.0 docs told plugin authors to import (the two reported breakages among them)."""
    for old in ("afd_connectors.zmq_control", "afd_sdk.hf"):
        sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning):
        from afd_connectors.zmq_control import ZmqControlPlane
        from afd_sdk.hf import RemoteExperts, TransformersBinding
    from afd_sdk.control import ZmqControlPlane as now
    from afd_sdk.integrations.transformers import TransformersBinding as binding_now
    from afd_sdk.proxy import RemoteExperts as experts_now

    assert (ZmqControlPlane, TransformersBinding, RemoteExperts) == (now, binding_now, experts_now)


def test_moved_names_warn_and_resolve():
    import afd_sdk.connector as connector
    import afd_sdk.runtime.attention_runner as runner
    from afd_sdk.dispatch import AsyncDispatchConnector

    with pytest.warns(DeprecationWarning, match="afd_sdk.connector.AsyncDispatchConnector .* afd_sdk.dispatch"):
        assert connector.AsyncDispatchConnector is AsyncDispatchConnector
    with pytest.warns(DeprecationWarning, match="split_stages .* afd_sdk.topology.even_blocks"):
        split_stages = runner.split_stages
    assert split_stages(5, 2) == [range(0, 3), range(3, 5)]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = connector.nope


def test_version_is_0_2_0_everywhere():
    from importlib.metadata import version

    assert afd_sdk.__version__ == "0.2.0" == version("afd-sdk")


def test_torch_extension_built_for_another_torch_is_refused_without_importing(monkeypatch):
    import torch

    from afd_connectors import native

    other = f"{torch.__version__}-other"
    record = {"torch": other, "cxx11_abi": True, "extensions": ["afd_connectors.zmq._zmqsteady"]}
    monkeypatch.setattr(native, "_build_record", lambda: record)
    imported = []
    monkeypatch.setattr(native, "importlib", types.SimpleNamespace(import_module=imported.append))
    module, problem = native.load("zmq._zmqsteady")
    assert module is None and imported == []
    assert f"built against torch {other}" in problem and "pip install --no-build-isolation" in problem
    # a module the build did not produce, and an unreadable record, vouch for nothing either
    assert "did not produce it" in native.load("shm._shmsteady")[1] and imported == []
    monkeypatch.setattr(native, "_build_record", lambda: {"unreadable": "bad json"})
    assert "build record is unusable" in native.load("p2p._p2pwire")[1] and imported == []
    monkeypatch.setattr(native, "_build_record", lambda: record)
    module, problem = native.load("zmq._zmqwire")  # a C module: no torch ABI to match, imported as usual
    assert imported == ["afd_connectors.zmq._zmqwire"] and problem is None


def test_torch_extension_without_a_build_record_says_it_was_not_built(monkeypatch):
    from afd_connectors import native

    monkeypatch.setattr(native, "_build_record", lambda: None)
    module, problem = native.load("p2p._p2pwire")
    assert module is None and "isolated pip build" in problem
    assert native.status()["afd_connectors.p2p._p2pwire"]["fallback"].startswith("P2pNcclAFDConnector")
