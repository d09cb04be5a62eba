"""The ``AFD<arch>`` aliases vLLM's general plugin must register: one per installed adapter with a vLLM model."""

from __future__ import annotations

from afd_sdk.adapter import afd_alias
from afd_sdk.plugins import get_plugin_manager


def expected_aliases() -> set[str]:
    """Every adapter architecture's alias that has a vLLM model class, as this tree's plugin manager lists them."""
    pm = get_plugin_manager()
    return {afd_alias(a) for a in pm.model_adapters.names() if pm.adapter_class(a).vllm_models.get(a)}
