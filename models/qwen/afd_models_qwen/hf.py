"""transformers binding factory for the Qwen adapter (imported only when used)."""

from __future__ import annotations

from afd_sdk.adapter import ModelAdapter
from afd_sdk.integrations.transformers import TransformersBinding

_CLASSES = {
    "Qwen3MoeForCausalLM": ("Qwen3MoeForCausalLM", False),
    # Qwen3.5-MoE is served text-only: the text causal LM, from the checkpoint's text config
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeForCausalLM", True),
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeForCausalLM", True),
    "Qwen3NextForCausalLM": ("Qwen3NextForCausalLM", False),
}


def transformers_binding(adapter: ModelAdapter) -> TransformersBinding:
    model_class, text_only = _CLASSES[adapter.architecture]
    return TransformersBinding.for_adapter(adapter, model_class, text_config=text_only)
