"""Entry point ``afd_sdk: deepseek``: registers each architecture with its adapter."""

from __future__ import annotations

from afd_models_deepseek.adapter import MLA_ARCHITECTURES, V4_ARCHITECTURES
from afd_sdk import hookimpl
from afd_sdk.hookspecs import Register


@hookimpl
def afd_register_model_adapters(register: Register) -> None:
    for arch in MLA_ARCHITECTURES:
        register(arch, "afd_models_deepseek.adapter:DeepseekAdapter")
    for arch in V4_ARCHITECTURES:
        register(arch, "afd_models_deepseek.adapter:DeepseekV4Adapter")
