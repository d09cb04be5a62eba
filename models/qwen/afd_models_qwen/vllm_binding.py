"""vLLM binding for the Qwen MoE adapter: how vLLM builds one layer's FFN (imported only when used).

Qwen3-MoE and Qwen3-Next. Qwen3.5-MoE's vLLM module needs torchvision, which
PyPI cannot pair with the CPU torch build; it has no binding yet.
"""

from __future__ import annotations

from typing import Any

import torch

from afd_sdk.adapter import ModelAdapter
from afd_sdk.errors import UnsupportedFeatureError
from afd_sdk.integrations.vllm import VllmBinding, fused_local_experts

#: vLLM's CPU attention kernels support head sizes 32, 64, 80, ... (not the tiny config's 8)
CPU_TINY = {"head_dim": 32}
#: vLLM's CPU gated-delta-net kernel (Qwen3-Next's linear attention) runs in bfloat16 with 64-wide heads
CPU_TINY_NEXT = {"head_dim": 32, "linear_key_head_dim": 64, "linear_value_head_dim": 64}

_MODULES = {
    # architecture: (vLLM module, decoder stack, MoE block, dense MLP)
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeModel", "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextModel", "Qwen3NextSparseMoeBlock", "Qwen3NextMLP"),
}


def vllm_binding(adapter: ModelAdapter) -> VllmBinding:
    arch = adapter.architecture
    if arch not in _MODULES:
        raise UnsupportedFeatureError(
            arch, "backend", "vllm", "the transformers reference runtime (vLLM's module for it needs torchvision)"
        )
    module, stack, moe_block, mlp = _MODULES[arch]
    path = f"vllm.model_executor.models.{module}"

    def build_ffn(vllm_config: Any, layer_idx: int, prefix: str) -> torch.nn.Module:
        import importlib

        mod = importlib.import_module(path)
        if adapter.layer_rules().is_moe_layer(layer_idx):  # the native decoder layer's own rule
            return getattr(mod, moe_block)(vllm_config=vllm_config, prefix=prefix)
        cfg = vllm_config.model_config.hf_text_config
        return getattr(mod, mlp)(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            hidden_act=cfg.hidden_act,
            quant_config=vllm_config.quant_config,
            prefix=prefix,
        )

    def inner_attrs(vllm_config: Any, layers: torch.nn.ModuleList) -> dict[str, Any]:
        if arch != "Qwen3NextForCausalLM":
            return {}
        # what Qwen3NextModel.__init__ sets and its load_weights reads
        import importlib

        from vllm.model_executor.layers.fused_moe.utils import is_model_fused_shared_expert_compatible

        block = getattr(importlib.import_module(path), moe_block)
        return {
            "config": vllm_config.model_config.hf_text_config,
            "is_fused_shared_expert_enabled": is_model_fused_shared_expert_compatible(layers, block, "mlp"),
        }

    if arch == "Qwen3NextForCausalLM":
        return VllmBinding(
            inner_class=f"{path}:{stack}",
            build_ffn=build_ffn,
            inner_attrs=inner_attrs,
            tiny_overrides=CPU_TINY_NEXT,
            cpu_dtype="bfloat16",
            ffn_classes=(f"{path}:{moe_block}", f"{path}:{mlp}"),
        )
    return VllmBinding(
        inner_class=f"{path}:{stack}",
        build_ffn=build_ffn,
        tiny_overrides=CPU_TINY,
        build_local_experts=fused_local_experts,
        ffn_classes=(f"{path}:{moe_block}", f"{path}:{mlp}"),
    )
