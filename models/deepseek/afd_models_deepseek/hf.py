"""transformers binding factory for the DeepSeek adapters (imported only when used)."""

from __future__ import annotations

from afd_sdk.adapter import ModelAdapter
from afd_sdk.errors import UnsupportedFeatureError
from afd_sdk.integrations.transformers import TransformersBinding


def transformers_binding(adapter: ModelAdapter) -> TransformersBinding:
    if adapter.tiny_hf_config(adapter.architecture) is None:
        raise UnsupportedFeatureError(
            adapter.architecture, "backend", "transformers", "vllm (no native transformers class exists)"
        )
    return TransformersBinding.for_adapter(adapter)
