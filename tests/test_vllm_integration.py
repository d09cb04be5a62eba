"""The vLLM integration without vLLM: register() is a no-op, registration logic on a fake registry."""

import logging
import sys
import types

import pytest

from afd_sdk.integrations.vllm import afd_config_from_vllm, register_model_aliases, worker_classes
from afd_sdk.integrations.vllm import plugin as integ
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
    assert worker_classes("ffn", "cuda")["command"] == "afd ffn serve --engine vllm"
    with pytest.raises(Exception, match="platform='tpu'"):
        worker_classes("attention", "tpu")


def _vllm_config(**parallel):
    return types.SimpleNamespace(parallel_config=types.SimpleNamespace(**parallel))


@pytest.mark.parametrize(
    ("parallel", "rank", "local"),
    [
        ({"data_parallel_size": 1, "data_parallel_index": 0, "data_parallel_rank": 0}, 0, 0),
        # `vllm serve --data-parallel-size 2`, the second engine of the host
        (
            {"data_parallel_size": 2, "data_parallel_index": 1, "data_parallel_rank": 1, "data_parallel_rank_local": 1},
            1,
            1,
        ),
        # `--headless --data-parallel-start-rank 3 --data-parallel-size-local 1`: alone on its node
        (
            {"data_parallel_size": 4, "data_parallel_index": 3, "data_parallel_rank": 3, "data_parallel_rank_local": 0},
            3,
            0,
        ),
    ],
    ids=["no-dp", "dp2-local", "headless-rank3"],
)
def test_attention_rank_is_the_global_dp_rank_and_the_metrics_offset_the_local_one(parallel, rank, local):
    from afd_sdk.config import parse_config
    from afd_sdk.integrations.vllm.model import _local_rank, _role_rank

    cfg = parse_config({"role": "attention", "num_attention_ranks": 4})
    assert _role_rank(cfg, _vllm_config(**parallel)) == rank
    assert _local_rank(_vllm_config(**parallel)) == local


def test_a_dense_models_independent_dp_engines_are_refused():
    """vLLM resets a dense model's DP size to 1 per engine but keeps its index: the engines would all claim rank 0."""
    from afd_sdk.config import parse_config
    from afd_sdk.errors import AFDConfigError
    from afd_sdk.integrations.vllm.model import _role_rank

    cfg = parse_config({"role": "attention", "num_attention_ranks": 2})
    independent = _vllm_config(data_parallel_size=1, data_parallel_index=1, data_parallel_rank=0)
    with pytest.raises(AFDConfigError, match="independent engine") as err:
        _role_rank(cfg, independent)
    assert err.value.key == "afd.num_attention_ranks"


def test_micro_batches_inside_vllm_are_refused_naming_the_key():
    """The alias model's constructor resolves the role with engine='vllm' before any resource (the tier's
    test_attention_engine_rejects_micro_batches_before_any_resource runs it in a real engine, -m slow)."""
    from afd_sdk.errors import AFDConfigError
    from afd_sdk.plugins import get_plugin_manager
    from afd_sdk.runtime.session import resolve_role

    arch = "Qwen3MoeForCausalLM"
    hf = {"architectures": [arch], **get_plugin_manager().adapter_class(arch).tiny_hf_config(arch)}
    cfg = {"role": "attention", "connector": "zmq", "num_stages": 2}
    with pytest.raises(AFDConfigError, match="one forward per step") as err:
        resolve_role(cfg, hf, engine="vllm")
    assert err.value.key == "afd.num_stages"
    assert resolve_role(cfg, hf, engine="reference")[0].num_stages == 2  # the reference runtime offers them
