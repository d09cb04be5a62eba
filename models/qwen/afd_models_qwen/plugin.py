"""Entry point ``afd_sdk: qwen``: registers the adapter once per architecture."""

from __future__ import annotations

from afd_models_qwen.adapter import ARCHITECTURES
from afd_sdk import hookimpl
from afd_sdk.hookspecs import Register


@hookimpl
def afd_register_model_adapters(register: Register) -> None:
    for arch in ARCHITECTURES:
        register(arch, "afd_models_qwen.adapter:QwenMoeAdapter")
