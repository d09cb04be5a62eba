"""Built-in plugin of ``afd_sdk`` itself: the metadata providers (contextvar; vLLM's ForwardContext).

Registered through the public hook like any third-party plugin.
"""

from __future__ import annotations

from afd_sdk.hookspecs import Register, hookimpl


@hookimpl
def afd_register_metadata_providers(register: Register) -> None:
    register("contextvar", "afd_sdk.metadata:ContextVarMetadataProvider")
    register("vllm", "afd_sdk.integrations.vllm:VllmMetadataProvider")
