"""What 0.2.0 gives plugin authors once instead of a copy each: the plan cache, the send record, the adapter
entry point, the gate-on-Attention check, the binding merge, the vLLM binding errors, log tails, baselines."""

from __future__ import annotations

import types

import pytest

from afd_sdk import Deployment, ModelAdapter, UnsupportedFeatureError, adapter_plugin
from afd_sdk.capabilities import ConnectorCapabilities
from afd_sdk.control import PLAN_CACHE_LIMIT, PlanCache, SendRecord
from afd_sdk.errors import AFDConfigError
from afd_sdk.plugins import AFDPluginManager


def test_plan_cache_is_bounded_and_clears_whole():
    cache: PlanCache[int, str] = PlanCache(limit=3)
    assert [cache.remember(k, str(k)) for k in range(3)] == ["0", "1", "2"] and len(cache) == 3
    cache.remember(3, "3")  # full: everything goes, then the new plan
    assert dict(cache) == {3: "3"}
    assert PlanCache().limit == PLAN_CACHE_LIMIT == 4096
    with pytest.raises(ValueError, match="limit=0 is invalid"):
        PlanCache(limit=0)


@pytest.mark.parametrize("connector", ["zmq", "shm"])
def test_send_record_holds_a_stage_from_send_to_receive(connector):
    import torch

    from afd_sdk.runtime.session import connector_from_spec
    from afd_sdk.runtime.world import free_port_block
    from afd_sdk.testing import init_in_threads
    from afd_sdk.wire import TransferMetadata

    spec = {
        "afd": {"connector": connector, "port": free_port_block(8), "timeout_s": 5},
        "model": {"architecture": "T", "hidden_size": 16, "dtype": "float32", "num_layers": 2},
        "max_num_tokens": 8,
    }
    ffn = connector_from_spec({**spec, "role": "ffn", "rank": 0})
    attn = connector_from_spec({**spec, "role": "attention", "rank": 0})
    try:
        init_in_threads(ffn, [attn], timeout_s=10)
        for layer in range(2):  # the second round is served by the steady state (native where built)
            x = torch.full((3, 16), float(layer))
            attn.send_attn_output(x, TransferMetadata(layer, 0, (3,)))
            assert isinstance(attn.sends, SendRecord) and attn.sends == {0: (layer, 3)}
            got = ffn.recv_attn_output(0)
            ffn.send_ffn_output(got.hidden_states + 1, got.metadata)
            assert torch.equal(attn.recv_ffn_output(x, 0), x + 1)
            assert attn.sends == {}
    finally:
        attn.close()
        ffn.close()


class _Gated(ModelAdapter):
    name = "gated-test"
    architectures = ("GatedTestForCausalLM",)

    def validate_deployment(self, d: Deployment) -> None:
        self.require_routed_dispatch(d)


def test_require_routed_dispatch_decides_by_capability():
    adapter = _Gated("GatedTestForCausalLM", {})
    adapter.validate_deployment(Deployment(compute_gate_on_attention=False))
    routed = ConnectorCapabilities(async_dispatch=True, world_layout="attention_first", attention_lt_ffn=True)
    adapter.validate_deployment(Deployment(compute_gate_on_attention=True, connector="Any", capabilities=routed))
    with pytest.raises(UnsupportedFeatureError, match="capabilities.async_dispatch=True") as info:
        adapter.validate_deployment(Deployment(compute_gate_on_attention=True, connector="ZmqAFDConnector"))
    assert "connector" in str(info.value)


def test_declared_bindings_extend_the_inherited_ones():
    class VllmOnly(ModelAdapter):
        bindings = {"vllm": "pkg.mod:vllm_binding"}

    class NoTransformers(VllmOnly):
        bindings = {"transformers": None}

    assert VllmOnly.bindings == {
        "transformers": "afd_sdk.integrations.transformers:default_binding",
        "vllm": "pkg.mod:vllm_binding",
    }
    assert NoTransformers.bindings == {"vllm": "pkg.mod:vllm_binding"}


def test_adapter_plugin_is_a_whole_entry_point_module():
    module = types.ModuleType("gated_plugin")
    module.afd_register_model_adapters = adapter_plugin(f"{__name__}:_Gated")
    pm = AFDPluginManager(load_entrypoints=False)
    pm.register_plugin(module, "gated")
    assert pm.adapter_class("GatedTestForCausalLM") is _Gated


def test_missing_inner_attr_names_the_binding_key():
    from afd_sdk.integrations.vllm.model import missing_inner_attr

    class Stack:
        def load_weights(self):
            return self.config

    model = types.SimpleNamespace(afd_inner_class=Stack, afd_inner_attrs=("use_mha",))
    inner = Stack()
    with pytest.raises(AttributeError) as info:
        inner.load_weights()
    err = missing_inner_attr(info.value, model, "MyMoeForCausalLM")
    assert isinstance(err, AFDConfigError) and err.key == "VllmBinding.inner_attrs" and err.value == "config"
    assert "reads attribute 'config'" in str(err) and "['use_mha']" in str(err)
    # an AttributeError of anything else passes through unchanged
    assert missing_inner_attr(AttributeError("x"), model, "MyMoeForCausalLM") is None


def test_log_tail_starts_at_a_line_and_says_what_it_left_out():
    from afd_sdk.runtime.world import log_tail

    text = "\n".join(f"line {i} with some words" for i in range(100))
    tail = log_tail(text, 60)
    first, *rest = tail.split("\n")
    assert first.startswith("[... ") and "earlier line(s) omitted" in first
    assert all(line.startswith("line ") and line.endswith("words") for line in rest), rest
    assert rest[-1] == "line 99 with some words"
    assert log_tail("short") == "short"


def test_benchmark_baselines_come_from_raw_baselines():
    from afd_connectors.cam.connector import CAMAsyncAFDConnector
    from afd_connectors.p2p.connector import P2pNcclAFDConnector
    from afd_connectors.shm.connector import ShmAFDConnector
    from afd_connectors.zmq.connector import ZmqAFDConnector
    from afd_sdk.bench.connector_bench import check_baselines, raw_transport_class

    assert check_baselines(ZmqAFDConnector, None) == ("zmq", "wire")
    assert check_baselines(P2pNcclAFDConnector, None) == ("gloo", "posted")
    assert check_baselines(ShmAFDConnector, None) == ("gloo", "zmq", "shm", "memcpy")
    assert check_baselines(CAMAsyncAFDConnector, None) == ("gloo",)

    class ThirdParty(ZmqAFDConnector):
        name = "ThirdPartyConnector"
        raw_baselines = {}

    assert check_baselines(ThirdParty, None) == ("zmq", "gloo")
    assert raw_transport_class("wire", ZmqAFDConnector).__name__ == "RawZmqWire"
    assert raw_transport_class("zmq", ZmqAFDConnector).__name__ == "RawZmq"  # declared None: the benchmark's


def test_the_attention_role_drops_vllms_references_to_replaced_ffn_modules():
    """afd_sdk.integrations.vllm.release on a model shaped like vLLM's: the MoE bookkeeping list and the layer
    registry hold the replaced experts; after the drop nothing does, and the weak references say so."""
    import torch

    from afd_sdk.integrations.vllm.release import drop_vllm_references, track

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(4, 2, bias=False)
            self.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
            for layer in self.layers:
                layer.mlp = torch.nn.Module()
                layer.mlp.experts = torch.nn.Linear(4, 4)
                layer.mlp.shared = self.gate  # a tensor the kept part owns, handed to the FFN module
            self.moe_layers = [layer.mlp.experts for layer in self.layers]

    model = Model()
    registry = {f"layers.{i}.mlp.experts": object() for i in range(2)} | {"layers.0.self_attn.attn": object()}
    config = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(static_forward_context=registry, static_all_moe_layers=list(registry))
    )
    config.compilation_config.static_forward_context["layers.1.mlp.experts"] = model.layers[1].mlp.experts
    replaced = [layer.mlp for layer in model.layers]
    names = [f"layers.{i}.mlp" for i in range(2)]
    tracked = track(replaced)
    for layer in model.layers:
        layer.mlp = torch.nn.Identity()  # the proxy
    assert tracked.alive() == (5, 4 * (16 + 4) * 2 + 4 * 2 * 4)  # still held by moe_layers and the registry
    drop_vllm_references(model, config, names, replaced)
    del replaced
    tracked = tracked.without(model)  # the gate stays: it was never the FFN's
    assert model.moe_layers == [] and list(registry) == ["layers.0.self_attn.attn"]
    assert config.compilation_config.static_all_moe_layers == ["layers.0.self_attn.attn"]
    assert len(tracked.refs) == 4 and tracked.alive() == (0, 0)
