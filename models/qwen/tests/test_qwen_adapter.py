import pytest

from afd_models_qwen.adapter import ARCHITECTURES, QwenMoeAdapter
from afd_sdk import AsyncDispatchConnector, Deployment, UnsupportedFeatureError, WeightRole
from afd_sdk.plugins import get_plugin_manager
from afd_sdk.testing.adapters import AdapterConformance

#: what a routed-dispatch connector declares: adapters decide gate on Attention by this, never by a name
ROUTED = AsyncDispatchConnector.capabilities

A, F, B, N = WeightRole.ATTENTION, WeightRole.FFN, WeightRole.BOTH, WeightRole.NONE
CFG = {"num_hidden_layers": 4, "num_experts": 8, "mlp_only_layers": [0]}

# name -> (role, role with compute_gate_on_attention)
GOLDEN = {
    "model.embed_tokens.weight": (A, A),
    "lm_head.weight": (A, A),
    "model.norm.weight": (A, A),
    "model.layers.1.self_attn.q_proj.weight": (A, A),
    "model.layers.1.self_attn.q_norm.weight": (A, A),
    "model.layers.1.linear_attn.A_log": (A, A),
    "model.layers.1.input_layernorm.weight": (A, A),
    "model.layers.1.post_attention_layernorm.weight": (A, A),
    "model.layers.1.mlp.gate.weight": (F, B),
    "model.layers.1.mlp.experts.3.down_proj.weight": (F, F),
    "model.layers.1.mlp.experts.gate_up_proj": (F, F),
    "model.layers.3.mlp.experts.down_proj": (F, F),
    "model.layers.1.mlp.shared_expert.up_proj.weight": (F, A),  # shared experts go with the gate (CAM)
    "model.layers.1.mlp.shared_expert_gate.weight": (F, A),
    "model.layers.0.mlp.gate_proj.weight": (F, A),  # dense (mlp_only_layers): runs locally with gate-on-attention
    "model.layers.0.mlp.down_proj.weight": (F, A),
    "model.layers.4.mlp.experts.0.up_proj.weight": (N, N),  # index >= num_hidden_layers: MTP
    "model.layers.4.self_attn.q_proj.weight": (N, N),
    "mtp.layers.0.mlp.experts.0.up_proj.weight": (N, N),
    "model.mtp.fc.weight": (N, N),
    "model.visual.blocks.0.attn.qkv.weight": (N, N),
    "visual.merger.linear_fc1.weight": (N, N),
    "model.vision_tower.patch_embed.weight": (N, N),
    "model.image_end": (N, N),
    "image_newline": (N, N),
    "model.aligner.fc.weight": (N, N),
    "model.language_model.layers.1.mlp.experts.0.up_proj.weight": (F, F),
    "model.language_model.embed_tokens.weight": (A, A),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_roles(name):
    adapter = QwenMoeAdapter("Qwen3MoeForCausalLM", CFG)
    plain, gated = GOLDEN[name]
    assert adapter.weight_role(name) is plain
    assert adapter.weight_role(name, compute_gate_on_attention=True) is gated


@pytest.mark.parametrize("name", ["model.layers.1.foo.weight", "something.weight", "model.layers.x.mlp.gate.weight"])
def test_unclassified_is_an_error_not_a_default(name):
    adapter = QwenMoeAdapter("Qwen3MoeForCausalLM", CFG)
    assert adapter.weight_role(name) is None
    with pytest.raises(Exception, match="match no weight-role rule") as ei:
        adapter.weight_roles(["lm_head.weight", name])
    assert name in str(ei.value)


def test_decoder_sparse_step():
    adapter = QwenMoeAdapter(
        "Qwen3MoeForCausalLM", {"num_hidden_layers": 4, "num_experts": 8, "decoder_sparse_step": 2}
    )
    assert adapter.weight_role("model.layers.0.mlp.gate_proj.weight", compute_gate_on_attention=True) is A  # dense
    assert adapter.weight_role("model.layers.1.mlp.gate.weight", compute_gate_on_attention=True) is B  # MoE


def test_qwen35_reads_text_config():
    adapter = QwenMoeAdapter(
        "Qwen3_5MoeForConditionalGeneration", {"text_config": {"num_hidden_layers": 2, "num_experts": 4}}
    )
    assert adapter.weight_role("model.language_model.layers.1.mlp.gate.weight") is F
    assert adapter.weight_role("model.language_model.layers.2.mlp.gate.weight") is N
    assert adapter.alias == "AFDQwen3_5MoeForConditionalGeneration"


CAM = Deployment(compute_gate_on_attention=True, connector="CAMAsyncAFDConnector", capabilities=ROUTED)


def test_gate_on_attention_with_cam_and_moe_layout():
    for arch in ARCHITECTURES:
        QwenMoeAdapter(arch, CFG).validate_deployment(CAM)
    adapter = QwenMoeAdapter("Qwen3MoeForCausalLM", {**CFG, "num_experts_per_tok": 2})
    layout = adapter.moe_layout()
    assert (layout.num_experts, layout.top_k, layout.moe_layers) == (8, 2, (1, 2, 3))
    assert QwenMoeAdapter("Qwen3MoeForCausalLM", {"num_hidden_layers": 2}).moe_layout() is None


def test_gate_on_attention_is_decided_by_capability_not_by_connector_name():
    third_party = Deployment(compute_gate_on_attention=True, connector="MyRdmaDispatch", capabilities=ROUTED)
    QwenMoeAdapter("Qwen3MoeForCausalLM", CFG).validate_deployment(third_party)
    named_cam_without_capability = Deployment(compute_gate_on_attention=True, connector="CAMAsyncAFDConnector")
    with pytest.raises(UnsupportedFeatureError, match="async_dispatch=True"):
        QwenMoeAdapter("Qwen3MoeForCausalLM", CFG).validate_deployment(named_cam_without_capability)


@pytest.mark.parametrize(
    ("arch", "deployment", "feature"),
    [
        ("Qwen3MoeForCausalLM", Deployment(compute_gate_on_attention=True), "connector"),
        ("Qwen3NextForCausalLM", Deployment(compute_gate_on_attention=True), "connector"),
        ("Qwen3_5MoeForCausalLM", Deployment(compute_gate_on_attention=True), "connector"),
        ("Qwen3MoeForCausalLM", Deployment(sequence_parallel_moe=True), "sequence_parallel_moe"),
        ("Qwen3MoeForCausalLM", Deployment(eplb=True), "eplb"),
        ("Qwen3MoeForCausalLM", Deployment(pipeline_parallel_size=2), "pipeline_parallel_size"),
        ("Qwen3MoeForCausalLM", Deployment(speculative_decoding=True), "speculative_decoding"),
        ("Qwen3MoeForCausalLM", Deployment(lora=True), "lora"),
        ("Qwen3MoeForCausalLM", Deployment(device="npu"), "device"),
        ("Qwen3_5MoeForConditionalGeneration", Deployment(multimodal=True), "multimodal"),
        ("Qwen3_5MoeForConditionalGeneration", Deployment(pipeline_parallel_size=2), "pipeline_parallel_size"),
        ("Qwen3NextForCausalLM", Deployment(eplb=True), "eplb"),
    ],
)
def test_feature_rejections(arch, deployment, feature):
    with pytest.raises(UnsupportedFeatureError) as ei:
        QwenMoeAdapter(arch, CFG).validate_deployment(deployment)
    assert ei.value.feature == feature and arch in str(ei.value) and "supported:" in str(ei.value)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_cpu_reference_runtime_is_supported(arch):
    QwenMoeAdapter(arch, CFG).validate_deployment(Deployment(device="cpu"))


def test_discovered_through_entry_point():
    pm = get_plugin_manager()
    for arch in ARCHITECTURES:
        entry = pm.model_adapters.entry(arch)
        assert entry.provenance.distribution == "afd-models-qwen"
        assert pm.adapter_class(arch) is QwenMoeAdapter


class TestQwenTransformersBinding(AdapterConformance):
    architectures = ARCHITECTURES
