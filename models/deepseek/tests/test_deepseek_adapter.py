import pytest

from afd_models_deepseek.adapter import MLA_ARCHITECTURES, V4_ARCHITECTURES, DeepseekAdapter, DeepseekV4Adapter
from afd_sdk import AsyncDispatchConnector, Deployment, UnsupportedFeatureError, WeightRole
from afd_sdk.plugins import get_plugin_manager
from afd_sdk.testing.adapters import AdapterConformance

#: what a routed-dispatch connector declares: adapters decide gate on Attention by this, never by a name
ROUTED = AsyncDispatchConnector.capabilities

A, F, B, N = WeightRole.ATTENTION, WeightRole.FFN, WeightRole.BOTH, WeightRole.NONE
CFG = {"num_hidden_layers": 4, "n_routed_experts": 8, "first_k_dense_replace": 1}

GOLDEN_MLA = {
    "model.embed_tokens.weight": (A, A),
    "lm_head.weight": (A, A),
    "model.norm.weight": (A, A),
    "model.layers.1.self_attn.kv_a_proj_with_mqa.weight": (A, A),
    "model.layers.1.self_attn.q_a_layernorm.weight": (A, A),
    "model.layers.1.self_attn.indexer.wk.weight": (A, A),
    "model.layers.1.input_layernorm.weight": (A, A),
    "model.layers.1.post_attention_layernorm.weight": (A, A),
    "model.layers.1.mlp.gate.weight": (F, B),
    "model.layers.1.mlp.gate.e_score_correction_bias": (F, B),
    "model.layers.1.mlp.experts.7.up_proj.weight": (F, F),
    "model.layers.1.mlp.experts.7.up_proj.weight_scale_inv": (F, F),
    "model.layers.2.mlp.experts.gate_up_proj": (F, F),
    "model.layers.1.mlp.shared_experts.gate_proj.weight": (F, A),  # shared experts go with the gate (CAM)
    "model.layers.0.mlp.down_proj.weight": (F, A),  # first_k_dense_replace
    "model.layers.4.eh_proj.weight": (N, N),  # MTP layer (index >= num_hidden_layers)
    "model.layers.4.mlp.experts.0.down_proj.weight": (N, N),
    "model.layers.4.embed_tokens.weight": (N, N),
    "model.image_end": (N, N),  # upstream V4.1 review: must not reach either loader
    "model.vision.patch.weight": (N, N),
    "aligner.layers.0.weight": (N, N),
}

GOLDEN_V4 = {
    "embed.weight": (A, A),
    "head.weight": (A, A),
    "norm.weight": (A, A),
    "hc_head_fn": (A, A),
    "model.hc_head.hc_base": (A, A),
    "layers.0.attn.wq_a.weight": (A, A),
    "layers.0.attn.compressor.wkv.weight": (A, A),
    "layers.0.attn_norm.weight": (A, A),
    "layers.0.ffn_norm.weight": (A, A),  # outside the FFN block despite its name
    "layers.0.hc_attn_fn": (A, A),
    "layers.0.hc_ffn_base": (A, A),  # hyper-connection mixing runs on Attention
    "layers.0.hc_ffn_scale": (A, A),
    "layers.0.ffn.gate.tid2eid": (F, F),  # hash-router table goes with the FFN
    "layers.1.ffn.gate.weight": (F, B),
    "layers.1.ffn.gate.bias": (F, B),
    "layers.1.ffn.experts.3.w1.weight": (F, F),
    "layers.1.ffn.shared_experts.w2.weight": (F, F),
    "model.layers.1.mlp.experts.gate_up_proj": (F, F),
    "model.layers.1.ffn_hc.fn": (A, A),
    "layers.2.engram.table.weight": (A, A),  # V4.1 Engram stays with Attention
    "engram.embeddings.weight": (A, A),
    "mtp.0.ffn.experts.0.w1.weight": (N, N),
    "layers.4.ffn.experts.0.w1.weight": (N, N),
    "model.image_end": (N, N),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_MLA))
@pytest.mark.parametrize("arch", MLA_ARCHITECTURES)
def test_golden_mla(arch, name):
    adapter = DeepseekAdapter(arch, CFG)
    plain, gated = GOLDEN_MLA[name]
    assert adapter.weight_role(name) is plain
    assert adapter.weight_role(name, compute_gate_on_attention=True) is gated


@pytest.mark.parametrize("name", sorted(GOLDEN_V4))
@pytest.mark.parametrize("arch", V4_ARCHITECTURES)
def test_golden_v4(arch, name):
    adapter = DeepseekV4Adapter(arch, {"num_hidden_layers": 4})
    plain, gated = GOLDEN_V4[name]
    assert adapter.weight_role(name) is plain
    assert adapter.weight_role(name, compute_gate_on_attention=True) is gated


def test_never_classified_by_substring_ffn():
    adapter = DeepseekV4Adapter("DeepseekV4ForCausalLM", {"num_hidden_layers": 4})
    assert adapter.weight_role("layers.0.ffn_norm.weight") is A
    assert adapter.weight_role("layers.0.something_ffn.weight") is None


def test_mlp_layer_types_decide_dense_layers():
    cfg = {"num_hidden_layers": 3, "n_routed_experts": 4, "mlp_layer_types": ["dense", "sparse", "dense"]}
    adapter = DeepseekAdapter("DeepseekV32ForCausalLM", cfg)
    assert adapter.weight_role("model.layers.2.mlp.down_proj.weight", compute_gate_on_attention=True) is A
    assert adapter.weight_role("model.layers.1.mlp.gate.weight", compute_gate_on_attention=True) is B


def test_v4_declares_input_ids_extra():
    (extra,) = DeepseekV4Adapter("DeepseekV4ForCausalLM", {}).ffn_extras()
    assert (extra.name, extra.dtype, extra.trailing_shape) == ("input_ids", "int32", ())
    assert DeepseekAdapter("DeepseekV3ForCausalLM", {}).ffn_extras() == ()


CAM = Deployment(compute_gate_on_attention=True, connector="CAMAsyncAFDConnector", capabilities=ROUTED)
V41_OK = Deployment(
    device="npu",
    compute_gate_on_attention=True,
    connector="CAMAsyncAFDConnector",
    capabilities=ROUTED,
)


@pytest.mark.parametrize(
    ("arch", "deployment", "feature"),
    [
        ("DeepseekV4ForCausalLM", Deployment(compute_gate_on_attention=True), "compute_gate_on_attention"),
        ("DeepseekV4ForCausalLM", Deployment(pipeline_parallel_size=2), "pipeline_parallel_size"),
        ("DeepseekV4ForCausalLM", Deployment(eplb=True), "eplb"),
        ("DeepseekV4ForCausalLM", Deployment(sequence_parallel_moe=True), "sequence_parallel_moe"),
        ("DeepseekV4ForCausalLM", Deployment(moe_backend="deep_gemm_mega_moe"), "moe_backend"),
        ("DeepseekV41ForCausalLM", Deployment(device="cuda"), "device"),
        (
            "DeepseekV41ForCausalLM",
            Deployment(device="npu", connector="CAMAsyncAFDConnector", capabilities=ROUTED),
            "compute_gate_on_attention",
        ),
        ("DeepseekV41ForCausalLM", Deployment(device="npu", compute_gate_on_attention=True), "connector"),
        ("DeepseekV41ForCausalLM", Deployment(**{**V41_OK.__dict__, "eplb": True}), "eplb"),
        (
            "DeepseekV41ForCausalLM",
            Deployment(**{**V41_OK.__dict__, "decode_context_parallel_size": 2}),
            "decode_context_parallel_size",
        ),
        (
            "DeepseekV41ForCausalLM",
            Deployment(**{**V41_OK.__dict__, "speculative_decoding": True}),
            "speculative_decoding",
        ),
        ("DeepseekV41ForCausalLM", Deployment(**{**V41_OK.__dict__, "lora": True}), "lora"),
        ("DeepseekV41ForCausalLM", Deployment(**{**V41_OK.__dict__, "engram": True, "num_stages": 2}), "num_stages"),
        ("DeepseekV3ForCausalLM", Deployment(multimodal=True), "multimodal"),
        ("DeepseekV3ForCausalLM", Deployment(compute_gate_on_attention=True), "connector"),
        ("DeepseekForCausalLM", CAM, "compute_gate_on_attention"),
        ("DeepseekForCausalLM", Deployment(device="cpu"), "device"),
    ],
)
def test_feature_rejections(arch, deployment, feature):
    cls = DeepseekV4Adapter if arch in V4_ARCHITECTURES else DeepseekAdapter
    with pytest.raises(UnsupportedFeatureError) as ei:
        cls(arch, CFG).validate_deployment(deployment)
    assert ei.value.feature == feature and arch in str(ei.value)


def test_accepted_deployments():
    DeepseekV4Adapter("DeepseekV41ForCausalLM", CFG).validate_deployment(V41_OK)
    DeepseekV4Adapter("DeepseekV41ForCausalLM", CFG).validate_deployment(
        Deployment(**{**V41_OK.__dict__, "engram": True})
    )
    DeepseekV4Adapter("DeepseekV4ForCausalLM", CFG).validate_deployment(Deployment(device="cpu"))
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"):
        DeepseekAdapter(arch, CFG).validate_deployment(Deployment(device="cpu"))
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"):
        DeepseekAdapter(arch, CFG).validate_deployment(CAM)


def test_moe_layout_skips_dense_layers():
    layout = DeepseekAdapter("DeepseekV3ForCausalLM", {**CFG, "num_experts_per_tok": 2}).moe_layout()
    assert (layout.num_experts, layout.top_k, layout.moe_layers) == (8, 2, (1, 2, 3))
    assert DeepseekAdapter("DeepseekV3ForCausalLM", {"num_hidden_layers": 2}).moe_layout() is None


def test_discovered_through_entry_point():
    pm = get_plugin_manager()
    for arch in MLA_ARCHITECTURES + V4_ARCHITECTURES:
        assert pm.model_adapters.entry(arch).provenance.distribution == "afd-models-deepseek"


class TestDeepseekTransformersBinding(AdapterConformance):
    # DeepSeek V1 and V4.1 have no transformers class, hence no tiny checkpoint to run the kit on
    architectures = tuple(
        a for a in MLA_ARCHITECTURES + V4_ARCHITECTURES if a not in ("DeepseekForCausalLM", "DeepseekV41ForCausalLM")
    )
