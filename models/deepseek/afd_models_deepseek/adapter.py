"""DeepSeek adapters.

``DeepseekAdapter`` covers the MLA generation (V1, V2, V3, V3.2 and
GLM-MoE-DSA, which share HF naming); ``DeepseekV4Adapter`` covers V4 and the
Ascend-only V4.1, whose checkpoints use native names (``attn``, ``ffn``,
``ffn_norm``, ``hc_*``) and whose first layers route by token id.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from afd_models_deepseek import __version__
from afd_sdk import Deployment, ExtraSpec, LayerRules, ModelAdapter
from afd_sdk.weight_rules import moe_layer_rule

MLA_ARCHITECTURES = (
    "DeepseekForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM",
)
V4_ARCHITECTURES = ("DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM")
#: MLA architectures whose MoE block the transformers binding splits at the routed experts (gate on Attention)
GATE_ON_ATTENTION = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
_MODEL_TYPE = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
    "DeepseekV4ForCausalLM": "deepseek_v4",
}
_TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    moe_intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    tie_word_embeddings=False,
)
# MLA: every head has its own latent K/V (kv heads = attention heads) and head_dim is the rope part
_MLA = dict(
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    head_dim=4,
    num_key_value_heads=4,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
)
_INDEXER = dict(index_topk=4, index_head_dim=8, index_n_heads=2)
_V4 = dict(
    q_lora_rank=16,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=2,
    index_head_dim=8,
    index_topk=4,
    qk_rope_head_dim=4,
    num_key_value_heads=1,
    hc_mult=2,
    num_hash_layers=1,
)


class DeepseekAdapter(ModelAdapter):
    """DeepSeek V1/V2/V3/V3.2 and GLM-MoE-DSA.

    Cut: ``layers.{i}.mlp`` — the MoE block (router gate with
    ``e_score_correction_bias``, routed and shared experts), or the dense MLP
    of the first ``first_k_dense_replace`` layers — is the FFN. MLA attention
    (and the V3.2 / GLM-DSA indexer), norms, embeddings and LM head stay on
    Attention; layers past ``num_hidden_layers`` (MTP) belong to neither.
    Weight roles, MoE layers (``first_k_dense_replace``, ``moe_layer_freq``)
    and the routed-expert layout (``n_routed_experts``) are derived from the
    declared cut (the defaults) and the config.
    """

    name = "deepseek"
    version = __version__
    architectures: ClassVar[tuple[str, ...]] = MLA_ARCHITECTURES
    bindings: ClassVar[Mapping[str, str]] = {
        "transformers": "afd_models_deepseek.hf:transformers_binding",
        "vllm": "afd_models_deepseek.vllm_binding:vllm_binding",
    }
    vllm_models: ClassVar[Mapping[str, str]] = {a: f"afd_models_deepseek.vllm_models:AFD{a}" for a in MLA_ARCHITECTURES}

    def validate_deployment(self, d: Deployment) -> None:
        if d.multimodal:
            raise self.reject("multimodal", True, "text-only serving (multimodal=False)")
        if d.compute_gate_on_attention:
            if self.architecture not in GATE_ON_ATTENTION:
                raise self.reject(
                    "compute_gate_on_attention", True, f"False (True only for {', '.join(GATE_ON_ATTENTION)})"
                )
            self.require_routed_dispatch(d)
        if d.device == "cpu" and self.architecture not in _MODEL_TYPE:
            raise self.reject(
                "device", "cpu", "cuda or npu (no native transformers class for the CPU reference runtime)"
            )

    @classmethod
    def tiny_hf_config(cls, architecture: str) -> dict[str, Any] | None:
        if architecture not in _MODEL_TYPE:
            return None
        extra = _INDEXER if architecture in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM") else {}
        return {"model_type": _MODEL_TYPE[architecture], **_TINY, **_MLA, **extra}


class DeepseekV4Adapter(ModelAdapter):
    """DeepSeek V4 and V4.1 (Ascend-only).

    Cut: ``layers.{i}.ffn`` (HF: ``mlp``) — gate (``weight``, ``bias``, and the
    hash-routing table ``tid2eid`` of the first layers), routed and shared
    experts — is the FFN. ``ffn_norm`` and the hyper-connection mixing
    parameters ``hc_attn_*`` / ``hc_ffn_*`` run outside the FFN block and stay
    on Attention, as do V4.1's Engram tables. The FFN needs the token ids
    (hash routing) as a token-aligned int32 extra.
    """

    name = "deepseek-v4"
    version = __version__
    architectures: ClassVar[tuple[str, ...]] = V4_ARCHITECTURES
    bindings: ClassVar[Mapping[str, str]] = {"transformers": "afd_models_deepseek.hf:transformers_binding"}
    vllm_models: ClassVar[Mapping[str, str]] = {a: f"afd_models_deepseek.vllm_models:AFD{a}" for a in V4_ARCHITECTURES}

    def layer_rules(self) -> LayerRules:
        # hand-written: the FFN block is ``ffn.`` in native names and ``mlp.`` in HF's; ``tid2eid`` (hash
        # routing) stays with the experts when the gate moves, and so do the shared experts (V4.1's CAM, as
        # upstream, sends shared-expert activations to the FFN ranks)
        if self._layer_rules is None:
            # every layer routes unless ``mlp_layer_types`` says "dense" (the first layers route by token id)
            types = self.hf_config.get("mlp_layer_types")
            self._layer_rules = LayerRules(
                int(self.hf_config.get("num_hidden_layers") or 0),
                moe_layer_rule(self.hf_config) if isinstance(types, list) else lambda i: True,
                ffn_prefixes=("mlp.", "ffn."),
                router_prefixes=("mlp.gate.", "ffn.gate."),
                shared_prefixes=(),
                ffn_always=("tid2eid",),
            )
        return self._layer_rules

    def ffn_extras(self) -> tuple[ExtraSpec, ...]:
        return (ExtraSpec("input_ids", "int32", description="token ids for hash routing on the first layers"),)

    def validate_deployment(self, d: Deployment) -> None:
        if self.architecture == "DeepseekV41ForCausalLM":
            self._validate_v41(d)
            return
        if d.compute_gate_on_attention:
            raise self.reject("compute_gate_on_attention", True, "gate on the FFN side (False)")
        if d.pipeline_parallel_size != 1:
            raise self.reject("pipeline_parallel_size", d.pipeline_parallel_size, "1")
        for feature in ("eplb", "sequence_parallel_moe"):
            if getattr(d, feature):
                raise self.reject(feature, True, "False")
        if d.moe_backend == "deep_gemm_mega_moe":
            raise self.reject("moe_backend", d.moe_backend, "any MoE backend except 'deep_gemm_mega_moe'")

    def _validate_v41(self, d: Deployment) -> None:
        if d.device != "npu":
            raise self.reject("device", d.device, "npu (DeepSeek V4.1 is Ascend-only)")
        if not d.compute_gate_on_attention:
            raise self.reject("compute_gate_on_attention", False, "True (gate on Attention)")
        self.require_routed_dispatch(d)
        for feature in ("eplb", "speculative_decoding", "lora"):
            if getattr(d, feature):
                raise self.reject(feature, True, "False")
        for feature in ("pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size"):
            if getattr(d, feature) != 1:
                raise self.reject(feature, getattr(d, feature), "1")
        if d.engram and d.num_stages > 1:
            raise self.reject("num_stages", d.num_stages, "1 when Engram is enabled (no micro-batching)")

    @classmethod
    def tiny_hf_config(cls, architecture: str) -> dict[str, Any] | None:
        if architecture != "DeepseekV4ForCausalLM":
            return None
        return {"model_type": "deepseek_v4", **_TINY, **_V4}
