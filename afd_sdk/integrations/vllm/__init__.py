"""vLLM integration: the ``vllm.general_plugins`` entry point, the ``AFD<arch>`` model
aliases constructed by role, the ``ForwardContext`` metadata provider, the
``additional_config["afd"]`` channel and the FFN role served from vLLM's modules.

* :mod:`~afd_sdk.integrations.vllm.plugin` — :func:`register` (the entry point) and the config channel;
* :mod:`~afd_sdk.integrations.vllm.provider` — :class:`VllmMetadataProvider`;
* :mod:`~afd_sdk.integrations.vllm.binding` — :class:`VllmBinding`, what an adapter declares for vLLM;
* :mod:`~afd_sdk.integrations.vllm.model` — the alias classes (Attention in vLLM's engine, FFN-only modules);
* :mod:`~afd_sdk.integrations.vllm.routed` — gate on Attention in vLLM (:func:`fused_local_experts`);
* :mod:`~afd_sdk.integrations.vllm.ffn` — the FFN role's server on vLLM's modules (``afd ffn serve --engine vllm``).

Nothing here imports vLLM at module import time.
"""

from afd_sdk.integrations.vllm.binding import FFNOnlyLayer, VllmBinding
from afd_sdk.integrations.vllm.model import EngineAttentionSide, afd_filter_weights, afd_model_class, lazy_alias_classes
from afd_sdk.integrations.vllm.plugin import afd_config_from_vllm, register, register_model_aliases, worker_classes
from afd_sdk.integrations.vllm.provider import METADATA_KEY, VllmMetadataProvider
from afd_sdk.integrations.vllm.routed import fused_local_experts

__all__ = [
    "METADATA_KEY",
    "EngineAttentionSide",
    "FFNOnlyLayer",
    "VllmBinding",
    "VllmMetadataProvider",
    "afd_config_from_vllm",
    "afd_filter_weights",
    "afd_model_class",
    "fused_local_experts",
    "lazy_alias_classes",
    "register",
    "register_model_aliases",
    "worker_classes",
]
