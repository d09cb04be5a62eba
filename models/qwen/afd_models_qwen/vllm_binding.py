"""vLLM binding for the Qwen3-MoE adapter: how vLLM builds one layer's FFN (imported only when used)."""

from __future__ import annotations

from typing import Any

import torch

from afd_models_qwen.adapter import QwenMoeAdapter
from afd_sdk.adapter import ModelAdapter
from afd_sdk.errors import UnsupportedFeatureError
from afd_sdk.integrations.vllm import VllmBinding

#: vLLM's CPU attention kernels support head sizes 32, 64, 80, 96, 112, 128, ... (not the tiny config's 8)
CPU_TINY = {"head_dim": 32}


def vllm_binding(adapter: ModelAdapter) -> VllmBinding:
    if adapter.architecture != "Qwen3MoeForCausalLM":
        raise UnsupportedFeatureError(
            adapter.architecture, "backend", "vllm", "the transformers reference runtime (no vLLM binding yet)"
        )
    assert isinstance(adapter, QwenMoeAdapter)

    def build_ffn(vllm_config: Any, layer_idx: int, prefix: str) -> torch.nn.Module:
        from vllm.model_executor.models.qwen3_moe import Qwen3MoeMLP, Qwen3MoeSparseMoeBlock

        if adapter.rules.is_moe_layer(layer_idx):  # the native decoder layer's own rule
            return Qwen3MoeSparseMoeBlock(vllm_config=vllm_config, prefix=prefix)
        cfg = vllm_config.model_config.hf_text_config
        return Qwen3MoeMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act,
                           quant_config=vllm_config.quant_config, prefix=prefix)  # fmt: skip

    return VllmBinding(
        inner_class="vllm.model_executor.models.qwen3_moe:Qwen3MoeModel", build_ffn=build_ffn, tiny_overrides=CPU_TINY
    )
