"""vLLM binding for the DeepSeek MLA adapter: how vLLM builds one layer's FFN (imported only when used)."""

from __future__ import annotations

from typing import Any

import torch

from afd_models_deepseek.adapter import DeepseekAdapter
from afd_sdk.adapter import ModelAdapter
from afd_sdk.errors import UnsupportedFeatureError
from afd_sdk.integrations.vllm import VllmBinding, fused_local_experts

#: the V2-derived family whose decoder layer is ``vllm...deepseek_v2.DeepseekV2DecoderLayer``
SUPPORTED = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
#: vLLM's CPU MLA backend supports only kv_lora_rank + qk_rope_head_dim == 576 (512 + 64)
CPU_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64}
#: DeepSeek-V3's router as vLLM implements it (grouped top-k on sigmoid scores with a correction bias)
V3_ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def vllm_binding(adapter: ModelAdapter) -> VllmBinding:
    if adapter.architecture not in SUPPORTED:
        raise UnsupportedFeatureError(
            adapter.architecture, "backend", "vllm", "the transformers reference runtime (no vLLM binding yet)"
        )
    assert isinstance(adapter, DeepseekAdapter)

    def build_ffn(vllm_config: Any, layer_idx: int, prefix: str) -> torch.nn.Module:
        from vllm._aiter_ops import rocm_aiter_ops
        from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLP, DeepseekV2MoE

        cfg = vllm_config.model_config.hf_config
        if adapter.layer_rules().is_moe_layer(layer_idx):  # first_k_dense_replace / moe_layer_freq, as the native layer
            return DeepseekV2MoE(
                config=cfg,
                parallel_config=vllm_config.parallel_config,
                quant_config=vllm_config.quant_config,
                prefix=prefix,
                apply_routed_scale_to_output=not rocm_aiter_ops.is_fused_moe_enabled(),
            )
        return DeepseekV2MLP(
            cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, quant_config=vllm_config.quant_config, prefix=prefix
        )

    def inner_attrs(vllm_config: Any, layers: torch.nn.ModuleList) -> dict[str, Any]:
        # what DeepseekV2Model.__init__ sets and its load_weights reads
        from vllm.model_executor.layers.fused_moe.utils import is_model_fused_shared_expert_compatible
        from vllm.model_executor.models.deepseek_v2 import DeepseekV2MoE

        cfg = vllm_config.model_config.hf_config
        return {
            "config": cfg,
            "use_mha": cfg.model_type == "deepseek" or not (cfg.qk_nope_head_dim or cfg.qk_rope_head_dim),
            "num_redundant_experts": vllm_config.parallel_config.eplb_config.num_redundant_experts,
            "is_fused_shared_expert_enabled": is_model_fused_shared_expert_compatible(layers, DeepseekV2MoE, "mlp"),
        }

    overrides = {**CPU_MLA, **(V3_ROUTER if adapter.architecture == "DeepseekV3ForCausalLM" else {})}
    return VllmBinding(
        inner_class="vllm.model_executor.models.deepseek_v2:DeepseekV2Model",
        build_ffn=build_ffn,
        inner_attrs=inner_attrs,
        tiny_overrides=overrides,
        build_local_experts=fused_local_experts,
        ffn_classes=(
            "vllm.model_executor.models.deepseek_v2:DeepseekV2MoE",
            "vllm.model_executor.models.deepseek_v2:DeepseekV2MLP",
        ),
    )
