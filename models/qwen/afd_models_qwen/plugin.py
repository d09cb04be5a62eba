"""Entry point ``afd_sdk: qwen``: registers the adapter under the architectures it declares."""

from afd_sdk import adapter_plugin

afd_register_model_adapters = adapter_plugin("afd_models_qwen.adapter:QwenMoeAdapter")
