"""The Qwen MoE adapter: where the cut is, who owns which tensor, what is unsupported."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from afd_models_qwen import __version__
from afd_sdk import Deployment, ModelAdapter

ARCHITECTURES = (
    "Qwen3MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM",
)

_MODEL_TYPE = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3NextForCausalLM": "qwen3_next",
}
_TINY_TEXT = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)
_LINEAR = dict(
    shared_expert_intermediate_size=16,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
)


class QwenMoeAdapter(ModelAdapter):
    """Qwen3-MoE, Qwen3.5-MoE (language model only) and Qwen3-Next.

    Cut: each decoder layer's ``mlp`` (sparse MoE block, or dense MLP on
    ``mlp_only_layers``) is the FFN; attention / linear attention, the layer
    norms, embeddings, final norm and LM head stay on Attention. Qwen3.5's
    vision tower and MTP layers belong to neither role.

    Everything but the feature rules is derived from the declared cut (the
    defaults ``model.layers`` / ``mlp``) and the config: weight roles, the
    MoE layers (``mlp_only_layers``, ``decoder_sparse_step``) and the routed
    experts (``num_experts``, ``num_experts_per_tok``).
    """

    name = "qwen"
    version = __version__
    architectures: ClassVar[tuple[str, ...]] = ARCHITECTURES
    bindings: ClassVar[Mapping[str, str]] = {
        "transformers": "afd_models_qwen.hf:transformers_binding",
        "vllm": "afd_models_qwen.vllm_binding:vllm_binding",
    }
    vllm_models: ClassVar[Mapping[str, str]] = {a: f"afd_models_qwen.vllm_models:AFD{a}" for a in ARCHITECTURES}

    def validate_deployment(self, d: Deployment) -> None:
        arch = self.architecture
        # gate on Attention exists only as the CAM split (routed experts dispatched by the connector); the
        # shared expert and Qwen3.5 / Qwen3-Next's sigmoid shared-expert gate then run on Attention too
        self.require_routed_dispatch(d)
        if arch.startswith("Qwen3_5"):
            if d.multimodal:
                raise self.reject("multimodal", True, "language-model-only serving (multimodal=False)")
            if d.pipeline_parallel_size != 1:
                raise self.reject("pipeline_parallel_size", d.pipeline_parallel_size, "1")
            return
        # Qwen3-MoE rules (upstream); Qwen3-Next follows them, having no broader support upstream.
        for feature in ("sequence_parallel_moe", "eplb", "speculative_decoding", "lora"):
            if getattr(d, feature):
                raise self.reject(feature, True, "False")
        if d.pipeline_parallel_size != 1:
            raise self.reject("pipeline_parallel_size", d.pipeline_parallel_size, "1")
        if d.device == "npu":
            raise self.reject("device", "npu", "cpu (reference runtime) or cuda")

    @classmethod
    def tiny_hf_config(cls, architecture: str) -> dict[str, Any] | None:
        model_type = _MODEL_TYPE[architecture]
        if architecture == "Qwen3MoeForCausalLM":
            return {"model_type": model_type, **_TINY_TEXT, "mlp_only_layers": [0]}
        if architecture == "Qwen3NextForCausalLM":
            return {"model_type": model_type, **_TINY_TEXT, **_LINEAR}
        text = {**_TINY_TEXT, **_LINEAR}
        if architecture == "Qwen3_5MoeForCausalLM":
            return {"model_type": model_type, **text}
        vision = dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=32,
            patch_size=4,
            temporal_patch_size=1,
            spatial_merge_size=1,
        )
        return {"model_type": model_type, "text_config": text, "vision_config": vision}
