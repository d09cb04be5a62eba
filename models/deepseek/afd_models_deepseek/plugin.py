"""Entry point ``afd_sdk: deepseek``: registers each adapter under the architectures it declares."""

from afd_sdk import adapter_plugin

afd_register_model_adapters = adapter_plugin(
    "afd_models_deepseek.adapter:DeepseekAdapter", "afd_models_deepseek.adapter:DeepseekV4Adapter"
)
