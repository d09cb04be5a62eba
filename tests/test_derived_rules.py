"""What the SDK derives for an adapter author: weight rules from the declared cut (with transformers'
checkpoint renames), the MoE layout from the config, the transformers binding; the public lookup;
the deployment facts both runtimes hand to ``validate_deployment``."""

from __future__ import annotations

import json
import types
from typing import Any, ClassVar

import pytest

from afd_sdk import (
    AFDConfigError,
    AsyncDispatchConnector,
    Deployment,
    LayerRules,
    ModelAdapter,
    PluginLoadError,
    UnclassifiedWeightError,
    UnknownNameError,
    WeightRole,
    adapter_class,
    adapter_for,
    hookimpl,
    register_adapter,
)
from afd_sdk.plugins import get_plugin_manager
from afd_sdk.testing.adapters import AdapterConformance
from afd_sdk.weight_rules import checkpoint_renames, moe_layer_rule

transformers = pytest.importorskip("transformers", reason="the kit and the renames come from transformers")

MIXTRAL = "MixtralForCausalLM"


class MixtralAdapter(ModelAdapter):
    """All a Mixtral adapter has to say: the cut is the usual one, so everything else is derived."""

    name = "mixtral-test"
    architectures: ClassVar[tuple[str, ...]] = (MIXTRAL,)

    @classmethod
    def tiny_hf_config(cls, architecture: str) -> dict[str, Any] | None:
        return dict(
            model_type="mixtral",
            vocab_size=96,
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=128,
            tie_word_embeddings=False,
        )


class MixtralWithoutRenames(MixtralAdapter):
    """The same cut, but blind to transformers' renames: checkpoint names (``block_sparse_moe``) match nothing."""

    def layer_rules(self) -> LayerRules:
        return LayerRules.from_cut(self.text_config, renames=())


def registered(adapter: type[ModelAdapter]) -> None:
    hook = hookimpl(lambda register: register_adapter(register, adapter))
    get_plugin_manager().register_plugin(types.SimpleNamespace(afd_register_model_adapters=hook), adapter.__name__)


class MixtralKit(AdapterConformance):
    architectures = (MIXTRAL,)


def test_mixtral_checkpoint_names_are_not_module_names():
    renames = checkpoint_renames("mixtral")
    assert any("block_sparse_moe" in pattern for pattern, _ in renames), renames
    rules = LayerRules.from_cut(MixtralAdapter.tiny_hf_config(MIXTRAL))
    assert (
        rules.module_name("model.layers.1.block_sparse_moe.experts.3.w1.weight") == "layers.1.mlp.experts.3.w1.weight"
    )


def test_a_mixtral_adapter_of_a_dozen_lines_passes_the_kit(fresh_plugins, tmp_path):
    registered(MixtralAdapter)
    kit = MixtralKit()
    for check in sorted(n for n in dir(kit) if n.startswith("test_")):
        getattr(kit, check)(tmp_path / check)


def test_without_the_renames_the_checkpoint_is_unclassified(fresh_plugins, tmp_path):
    registered(MixtralWithoutRenames)
    with pytest.raises(UnclassifiedWeightError, match="block_sparse_moe"):
        MixtralKit().test_role_split_is_complete_and_exact(tmp_path)


def test_derived_layout_and_roles():
    adapter = MixtralAdapter(MIXTRAL, MixtralAdapter.tiny_hf_config(MIXTRAL))
    layout = adapter.moe_layout()
    assert (layout.num_experts, layout.top_k, layout.moe_layers) == (4, 2, (0, 1))
    role = adapter.weight_role
    assert role("model.layers.0.block_sparse_moe.gate.weight") is WeightRole.FFN
    assert role("model.layers.0.block_sparse_moe.gate.weight", compute_gate_on_attention=True) is WeightRole.BOTH
    assert role("model.layers.0.self_attn.q_proj.weight") is WeightRole.ATTENTION
    assert role("model.layers.0.input_layernorm.weight") is WeightRole.ATTENTION
    assert role("model.layers.2.self_attn.q_proj.weight") is WeightRole.NONE  # past the last layer (MTP)
    assert role("model.layers.0.mystery.weight") is None  # unknown per-layer part: an error, never a default
    assert role("model.vision_tower.blocks.0.weight") is WeightRole.NONE


def test_attention_parts_extend_the_layer_and_the_dense_model_has_no_layout():
    class Custom(MixtralAdapter):
        attention_parts = ("my_norm",)

    cfg = {**MixtralAdapter.tiny_hf_config(MIXTRAL), "num_local_experts": 0}
    adapter = Custom(MIXTRAL, cfg)
    assert adapter.weight_role("model.layers.1.my_norm.weight") is WeightRole.ATTENTION
    assert adapter.moe_layout() is None
    # a dense layer's MLP is the FFN's, and moves to Attention with the gate
    assert adapter.weight_role("model.layers.1.block_sparse_moe.gate.weight") is WeightRole.FFN
    assert (
        adapter.weight_role("model.layers.1.mlp.up_proj.weight", compute_gate_on_attention=True) is WeightRole.ATTENTION
    )


@pytest.mark.parametrize(
    ("config", "moe"),
    [
        ({"num_experts": 4, "mlp_only_layers": [0], "num_hidden_layers": 4}, [1, 2, 3]),
        ({"num_experts": 4, "decoder_sparse_step": 2, "num_hidden_layers": 4}, [1, 3]),
        ({"n_routed_experts": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_hidden_layers": 3}, [1, 2]),
        ({"num_local_experts": 8, "num_hidden_layers": 2}, [0, 1]),
        ({"mlp_layer_types": ["dense", "sparse", "sparse"], "num_hidden_layers": 3}, [1, 2]),
        ({"intermediate_size": 64, "num_hidden_layers": 2}, []),
    ],
)
def test_moe_layers_from_the_standard_keys(config, moe):
    rule = moe_layer_rule(config)
    assert [i for i in range(config["num_hidden_layers"]) if rule(i)] == moe


def test_bundled_adapters_derive_what_the_hand_written_rules_said(fresh_plugins, tmp_path):
    """Qwen and DeepSeek-MLA now derive their rules; they classify every tiny checkpoint name as the
    hand-written engine (the standard attention parts, the config's MoE layers) did."""
    from afd_sdk.integrations.transformers import save_tiny_checkpoint
    from afd_sdk.weights import read_checkpoint

    for arch in (
        "Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
    ):
        ckpt = save_tiny_checkpoint(arch, tmp_path / arch)
        adapter = adapter_for(ckpt)
        hand = LayerRules(int(adapter.text_config["num_hidden_layers"]), moe_layer_rule(adapter.text_config))
        for name in read_checkpoint(ckpt).names:
            for gate in (False, True):
                derived = adapter.weight_role(name, compute_gate_on_attention=gate)
                assert derived is hand.role(name, compute_gate_on_attention=gate), (arch, name, gate)
                assert derived is not None, (arch, name)


def test_public_lookup(fresh_plugins, tmp_path):
    from afd_models_qwen.adapter import QwenMoeAdapter

    assert adapter_class("Qwen3MoeForCausalLM") is QwenMoeAdapter
    assert adapter_class("AFDQwen3MoeForCausalLM") is QwenMoeAdapter  # the vLLM alias names the same adapter
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], **QwenMoeAdapter.tiny_hf_config("Qwen3MoeForCausalLM")}
    assert isinstance(adapter_for(cfg), QwenMoeAdapter)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert adapter_for(tmp_path).architecture == "Qwen3MoeForCausalLM"
    with pytest.raises(UnknownNameError, match="NopeForCausalLM"):
        adapter_class("NopeForCausalLM")
    with pytest.raises(AFDConfigError, match="architectures"):
        adapter_for({"model_type": "qwen3_moe"})


def test_register_adapter_registers_every_declared_architecture_and_rejects_what_is_no_adapter():
    calls: list[tuple[str, object]] = []
    register_adapter(lambda name, target: calls.append((name, target)), "afd_models_qwen.adapter:QwenMoeAdapter")
    from afd_models_qwen.adapter import ARCHITECTURES

    assert [n for n, _ in calls] == list(ARCHITECTURES)
    assert {t for _, t in calls} == {"afd_models_qwen.adapter:QwenMoeAdapter"}  # registered lazily, as given
    with pytest.raises(PluginLoadError, match="no ModelAdapter subclass"):
        register_adapter(lambda *a: None, "afd_sdk.weights:read_checkpoint")


class Recording(MixtralAdapter):
    seen: ClassVar[list[Deployment]] = []

    def validate_deployment(self, deployment: Deployment) -> None:
        Recording.seen.append(deployment)


def test_the_reference_runtime_hands_capabilities_and_quantization_to_the_adapter(fresh_plugins):
    from afd_sdk.runtime.session import resolve_role

    registered(Recording)
    Recording.seen.clear()
    hf = {"architectures": [MIXTRAL], **MixtralAdapter.tiny_hf_config(MIXTRAL)}
    resolve_role({"role": "ffn", "connector": "zmq"}, hf, features={"quantization": "fp8"})
    resolve_role({"role": "ffn", "connector": "CAMAsyncAFDConnector", "compute_gate_on_attention": True}, hf)
    plain, cam = Recording.seen
    assert plain.quantization == "fp8" and not plain.async_dispatch
    assert plain.capabilities.world_layout == "ffn_first"
    assert cam.async_dispatch and cam.capabilities.async_dispatch and cam.compute_gate_on_attention
    assert cam.capabilities == get_plugin_manager().connector_class("CAMAsyncAFDConnector").capabilities


def test_validate_role_reads_the_checkpoints_quantization(fresh_plugins, tmp_path):
    from afd_sdk.runtime.session import validate_role

    registered(Recording)
    Recording.seen.clear()
    cfg = {
        "architectures": [MIXTRAL],
        **MixtralAdapter.tiny_hf_config(MIXTRAL),
        "quantization_config": {"quant_method": "mxfp4"},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    validate_role({"role": "ffn"}, tmp_path)
    assert Recording.seen[-1].quantization == "mxfp4"


def test_deployment_decides_by_capabilities():
    assert Deployment().async_dispatch is False
    assert Deployment(capabilities=AsyncDispatchConnector.capabilities).async_dispatch is True
