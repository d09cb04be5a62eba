import importlib.metadata as md
import types

import pytest

from afd_sdk import AFDConnector, hookimpl
from afd_sdk.adapter import ModelAdapter
from afd_sdk.config import parse_config
from afd_sdk.errors import AFDConfigError, PluginLoadError, RegistrationError, UnknownNameError
from afd_sdk.plugins import AFDPluginManager


class DummyConnector(AFDConnector):
    name = "DummyConnector"
    init = close = send_attn_output = recv_ffn_output = recv_attn_output = send_ffn_output = lambda *a, **k: None
    is_initialized = False


class NotAConnector:
    pass


class DummyAdapter(ModelAdapter):
    name = "dummy"
    architectures = ("DummyForCausalLM",)

    def weight_role(self, name, *, compute_gate_on_attention=False):
        return None


def plugin(**hooks):
    ns = types.SimpleNamespace()
    for hook, fn in hooks.items():
        setattr(ns, hook, hookimpl(fn))
    return ns


def connectors(*entries):
    def afd_register_connectors(register):
        for name, target, aliases in entries:
            register(name, target, aliases=aliases)

    return afd_register_connectors


def test_builtins_register_through_hooks():
    pm = AFDPluginManager(load_entrypoints=False, env={})
    assert {"ZmqAFDConnector", "P2pNcclAFDConnector"} <= set(pm.connectors.names())
    assert pm.connector_class("zmq").name == "ZmqAFDConnector"
    assert pm.connectors.entry("p2p").provenance.distribution == "afd-sdk"
    assert pm.metadata_provider().current() is None
    assert all(r.kind == "builtin" and r.status == "loaded" for r in pm.records.values())


def test_register_unregister_in_process():
    pm = AFDPluginManager(load_entrypoints=False, env={})
    pm.register_plugin(
        plugin(afd_register_connectors=connectors(("DummyConnector", DummyConnector, ("dummy",)))), "mine"
    )
    assert pm.connector_class("dummy") is DummyConnector
    assert pm.records["mine"].registered["connectors"] == ["DummyConnector"]
    pm.unregister_plugin("mine")
    with pytest.raises(UnknownNameError):
        pm.connector_class("dummy")


def test_duplicate_and_alias_clash_name_both_providers():
    pm = AFDPluginManager(load_entrypoints=False, env={})
    rec = pm.register_plugin(plugin(afd_register_connectors=connectors(("Other", DummyConnector, ("zmq",)))), "clash")
    assert rec.status == "failed"
    assert "'zmq'" in rec.error and "clashes with the alias 'zmq' of connector 'ZmqAFDConnector'" in rec.error
    assert "afd_connectors.plugin" in rec.error and "clash" in rec.error
    # the built-in keeps working
    assert pm.connector_class("zmq").name == "ZmqAFDConnector"
    # the clashing registration is refused whole; asking for it points at the failed plugin
    with pytest.raises(UnknownNameError, match=r"clash \(in-process\): RegistrationError"):
        pm.connector_class("Other")
    assert isinstance(pm.records["clash"].failure.cause, RegistrationError)


def test_hook_that_raises_is_recorded_and_others_work():
    def boom(register):
        register("Half", DummyConnector)
        raise RuntimeError("driver missing")

    pm = AFDPluginManager(load_entrypoints=False, env={})
    rec = pm.register_plugin(plugin(afd_register_connectors=boom), "broken")
    assert rec.status == "failed" and "driver missing" in rec.error
    with pytest.raises(PluginLoadError, match="driver missing") as ei:
        pm.connector_class("Half")
    assert isinstance(ei.value.cause, RuntimeError) and ei.value.plugin == "broken"
    assert pm.connector_class("p2p").name == "P2pNcclAFDConnector"


def test_unknown_hook_is_a_failed_plugin():
    ns = types.SimpleNamespace(afd_register_conectors=hookimpl(lambda register: None))
    pm = AFDPluginManager(load_entrypoints=False, env={})
    rec = pm.register_plugin(ns, "typo")
    assert rec.status == "failed" and "afd_register_conectors" in rec.error


def test_unknown_name_lists_known_and_closest():
    pm = AFDPluginManager(load_entrypoints=False, env={})
    with pytest.raises(
        UnknownNameError, match=r"connector 'zmqq' is not registered; did you mean 'zmq'\?.*known: "
    ) as ei:
        pm.connector_class("zmqq")
    assert isinstance(ei.value, AFDConfigError)


def test_abc_check_and_lazy_import_failure():
    pm = AFDPluginManager(load_entrypoints=False, env={})
    pm.register_plugin(
        plugin(
            afd_register_connectors=connectors(
                ("NotOne", NotAConnector, ()),
                ("Missing", "no_such_module_xyz:Thing", ()),
                ("BadForm", "nocolon", ()),
            )
        ),
        "lazy",
    )
    with pytest.raises(
        TypeError, match=r"connector 'NotOne' from plugin 'lazy'.*not a subclass of afd_sdk.connector.AFDConnector"
    ):
        pm.connector_class("NotOne")
    with pytest.raises(PluginLoadError, match="no_such_module_xyz:Thing") as ei:
        pm.connector_class("Missing")
    assert ei.value.plugin == "lazy"
    with pytest.raises(PluginLoadError, match="not of the form"):
        pm.connector_class("BadForm")


def test_model_adapter_registry():
    def reg(register):
        register("DummyForCausalLM", DummyAdapter)

    pm = AFDPluginManager(load_entrypoints=False, env={})
    pm.register_plugin(plugin(afd_register_model_adapters=reg), "adapters")
    cls = pm.adapter_class("DummyForCausalLM")
    assert cls("DummyForCausalLM", {}).alias == "AFDDummyForCausalLM"
    with pytest.raises(AFDConfigError, match="is not handled by adapter dummy"):
        cls("Other", {})


def test_validate_config_hook_veto_and_extra_parse():
    def veto(config):
        if config.num_stages > 2:
            raise AFDConfigError("afd.num_stages=3 is invalid; expected <= 2 for my plugin", key="afd.num_stages")

    pm = AFDPluginManager(load_entrypoints=False, env={})
    pm.register_plugin(plugin(afd_validate_config=veto), "veto")
    ok = pm.resolve_config(
        parse_config({"role": "ffn", "connector": "zmq", "connector_extra_config": {"transport": "ipc"}})
    )
    assert ok.extra_config.transport == "ipc"
    with pytest.raises(AFDConfigError, match="expected <= 2"):
        pm.resolve_config(parse_config({"role": "ffn", "num_stages": 3}))
    with pytest.raises(AFDConfigError, match="connector_extra_config.transprt is not accepted by ZmqAFDConnector"):
        pm.resolve_config(parse_config({"role": "ffn", "connector_extra_config": {"transprt": "ipc"}}))
    with pytest.raises(AFDConfigError, match="num_attention_ranks=1 < num_ffn_ranks=2"):
        pm.resolve_config(parse_config({"role": "ffn", "connector": "p2p", "num_ffn_ranks": 2}))


class FakeDist:
    def __init__(self, name, version="1.0"):
        self.name, self.version = name, version


class FakeEP:
    def __init__(self, name, loader, dist):
        self.name, self._loader, self.dist = name, loader, FakeDist(dist)

    def load(self):
        return self._loader()


def _fake_eps(monkeypatch, eps):
    real = md.entry_points

    def entry_points(**kw):
        if kw.get("group") == "afd_sdk":
            return eps
        return real(**kw)

    monkeypatch.setattr(md, "entry_points", entry_points)


def test_entrypoints_allow_block_and_import_failure(monkeypatch):
    good = plugin(afd_register_connectors=connectors(("DummyConnector", DummyConnector, ())))

    def bad():
        raise ImportError("cannot import name 'rdma' from 'ibverbs'")

    _fake_eps(monkeypatch, [FakeEP("good", lambda: good, "good-dist"), FakeEP("bad", bad, "bad-dist")])
    pm = AFDPluginManager(env={})
    assert pm.records["good"].status == "loaded" and pm.records["good"].distribution == "good-dist"
    assert pm.records["bad"].status == "failed" and "ibverbs" in pm.records["bad"].error
    assert pm.connector_class("DummyConnector") is DummyConnector
    with pytest.raises(UnknownNameError, match="bad \\(bad-dist\\).*ibverbs"):
        pm.connector_class("RdmaConnector")

    pm = AFDPluginManager(env={"AFD_PLUGINS": "bad"})
    assert pm.records["good"].status == "skipped" and pm.records["good"].reason == "not in AFD_PLUGINS"
    pm = AFDPluginManager(env={"AFD_PLUGINS": ""})
    assert {r.status for n, r in pm.records.items() if r.kind == "entrypoint"} == {"skipped"}
    pm = AFDPluginManager(env={"AFD_DISABLE_PLUGINS": "good, afd_connectors.plugin"})
    assert pm.records["good"].reason == "in AFD_DISABLE_PLUGINS"
    assert "zmq" not in pm.connectors
