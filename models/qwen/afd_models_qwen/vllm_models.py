"""vLLM AFD alias classes for the Qwen family, built on first access.

vLLM's registry resolves ``AFD<arch>`` to ``afd_models_qwen.vllm_models:AFD<arch>``;
this module imports vLLM only then.
"""

from afd_models_qwen.adapter import QwenMoeAdapter
from afd_sdk.integrations.vllm import lazy_alias_classes

NATIVE_MODULES = {
    "Qwen3MoeForCausalLM": "vllm.model_executor.models.qwen3_moe",
    "Qwen3_5MoeForConditionalGeneration": "vllm.model_executor.models.qwen3_5",
    "Qwen3_5MoeForCausalLM": "vllm.model_executor.models.qwen3_5",
    "Qwen3NextForCausalLM": "vllm.model_executor.models.qwen3_next",
}

__getattr__ = lazy_alias_classes(__name__, NATIVE_MODULES, QwenMoeAdapter)
