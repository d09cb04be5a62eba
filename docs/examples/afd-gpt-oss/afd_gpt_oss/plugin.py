"""Entry point ``afd_sdk: gpt_oss``: registers the adapter under the architectures it declares."""

from __future__ import annotations

from afd_sdk import hookimpl, register_adapter
from afd_sdk.hookspecs import Register


@hookimpl
def afd_register_model_adapters(register: Register) -> None:
    register_adapter(register, "afd_gpt_oss.adapter:GptOssAdapter")
