"""vLLM AFD alias classes for the Qwen family, built on first access.

vLLM's registry resolves ``AFD<arch>`` to ``afd_models_qwen.vllm_models:AFD<arch>``;
this module imports vLLM only then.
"""

from afd_models_qwen.adapter import QwenMoeAdapter
from afd_sdk.integrations.vllm import lazy_alias_classes

__getattr__ = lazy_alias_classes(__name__, None, QwenMoeAdapter)  # native modules: vLLM's own registry
