"""The vLLM integration without vLLM: register() is a no-op, registration logic on a fake registry."""

import logging
import sys
import types

import pytest

from afd_sdk.integrations import vllm as integ
from afd_sdk.integrations.vllm import afd_config_from_vllm, register_model_aliases, worker_classes
from afd_sdk.plugins import AFDPluginManager


def test_register_without_vllm_does_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    monkeypatch.setattr(integ, "_registered", False)
    integ.register()
    assert integ._registered is False


class FakeRegistry:
    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def register_model(self, name, target):
        if self.fail:
            raise RuntimeError("registry broken")
        self.calls.append((name, target))


def test_aliases_registered_lazily_by_path():
    pm = AFDPluginManager(env={})
    reg = FakeRegistry()
    names = register_model_aliases(reg, pm)
    assert ("AFDQwen3MoeForCausalLM", "afd_models_qwen.vllm_models:AFDQwen3MoeForCausalLM") in reg.calls
    assert ("AFDDeepseekV4ForCausalLM", "afd_models_deepseek.vllm_models:AFDDeepseekV4ForCausalLM") in reg.calls
    assert len(names) == 11 and all(isinstance(t, str) for _, t in reg.calls)
    assert "afd_models_qwen.vllm_models" not in sys.modules or sys.modules["afd_models_qwen.vllm_models"] is not None


def test_required_step_failure_propagates_and_retries(monkeypatch):
    fake_vllm = types.ModuleType("vllm")
    fake_vllm.ModelRegistry = FakeRegistry(fail=True)
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setattr(integ, "_registered", False)
    with pytest.raises(RuntimeError, match="registry broken"):
        integ.register()
    assert integ._registered is False
    fake_vllm.ModelRegistry = FakeRegistry()
    integ.register()
    assert integ._registered is True and len(fake_vllm.ModelRegistry.calls) == 11
    integ.register()  # idempotent
    assert len(fake_vllm.ModelRegistry.calls) == 11


def test_failed_adapter_plugin_is_a_warning_with_cause(caplog):
    pm = AFDPluginManager(env={})

    def boom(register):
        register("BrokenMoeForCausalLM", "no_such_module_zz:Adapter")
        raise RuntimeError("adapter plugin exploded")

    ns = types.SimpleNamespace(afd_register_model_adapters=__import__("afd_sdk").hookimpl(boom))
    pm.register_plugin(ns, "broken-adapters")
    with caplog.at_level(logging.WARNING, logger="afd_sdk.integrations.vllm"):
        names = register_model_aliases(FakeRegistry(), pm)
    assert len(names) == 11
    text = caplog.text
    assert "broken-adapters" in text and "adapter plugin exploded" in text
    assert "BrokenMoeForCausalLM" in text


def test_config_channel():
    vc = types.SimpleNamespace(additional_config={"afd": {"afd_role": "ffn", "afd_connector": "p2p"}})
    cfg = afd_config_from_vllm(vc)
    assert cfg.role == "ffn" and cfg.connector == "p2p"
    assert afd_config_from_vllm(types.SimpleNamespace(additional_config={})) is None
    assert afd_config_from_vllm(types.SimpleNamespace(additional_config=None)) is None
    assert worker_classes("attention", "cuda") == {"worker_cls": "vllm.v1.worker.gpu_worker.Worker"}
    assert worker_classes("ffn", "cuda")["command"] == "afd ffn serve"
    with pytest.raises(Exception, match="platform='tpu'"):
        worker_classes("attention", "tpu")


def test_alias_places_the_shared_ffn_proxy_on_the_attention_role():
    """The vLLM alias puts the same RemoteFFN at the cut as the transformers binding (no vLLM needed)."""
    import types

    import torch

    from afd_models_qwen.adapter import QwenMoeAdapter
    from afd_sdk.integrations.vllm import VllmMetadataProvider, afd_model_class
    from afd_sdk.proxy import RemoteFFN

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Linear(4, 4)

    class Native(torch.nn.Module):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([Layer(), Layer()])

    def vllm_config(role, gate=False):
        hf = types.SimpleNamespace(to_dict=lambda: {"num_hidden_layers": 2, "num_experts": 4})
        return types.SimpleNamespace(
            additional_config={"afd": {"role": role, "compute_gate_on_attention": gate}},
            model_config=types.SimpleNamespace(hf_config=hf),
        )

    cls = afd_model_class(Native, "Qwen3MoeForCausalLM", QwenMoeAdapter)
    attention = cls(vllm_config=vllm_config("attention"))
    for i, layer in enumerate(attention.model.layers):
        assert isinstance(layer.mlp, RemoteFFN) and layer.mlp.layer_idx == i
        assert isinstance(layer.mlp.provider, VllmMetadataProvider)
        assert not list(layer.mlp.parameters())
    ffn = cls(vllm_config=vllm_config("ffn"))
    assert all(isinstance(layer.mlp, torch.nn.Linear) for layer in ffn.model.layers)
