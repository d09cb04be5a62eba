"""vLLM AFD alias classes for the DeepSeek family, built on first access.

vLLM's registry resolves ``AFD<arch>`` to ``afd_models_deepseek.vllm_models:AFD<arch>``;
this module imports vLLM only then.
"""

from afd_models_deepseek.adapter import DeepseekAdapter, DeepseekV4Adapter
from afd_sdk.integrations.vllm import lazy_alias_classes

MLA_NATIVE = {
    "DeepseekForCausalLM": "vllm.model_executor.models.deepseek_v2",
    "DeepseekV2ForCausalLM": "vllm.model_executor.models.deepseek_v2",
    "DeepseekV3ForCausalLM": "vllm.model_executor.models.deepseek_v2",
    "DeepseekV32ForCausalLM": "vllm.models.deepseek_v32",
    "GlmMoeDsaForCausalLM": "vllm.models.deepseek_v32",
}
V4_NATIVE = {
    "DeepseekV4ForCausalLM": "vllm.models.deepseek_v4",
    "DeepseekV41ForCausalLM": "vllm.models.deepseek_v41",
}

_mla = lazy_alias_classes(__name__, MLA_NATIVE, DeepseekAdapter)
_v4 = lazy_alias_classes(__name__, V4_NATIVE, DeepseekV4Adapter)


def __getattr__(name: str) -> type:
    return _v4(name) if name.removeprefix("AFD") in V4_NATIVE else _mla(name)
