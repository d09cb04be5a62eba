"""``VllmMetadataProvider``: forward metadata inside vLLM's ``ForwardContext``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from afd_sdk.metadata import ForwardMetadata, MetadataProvider

__all__ = ["METADATA_KEY", "VllmMetadataProvider"]

#: where the forward metadata lives inside vLLM's ForwardContext
METADATA_KEY = "afd_metadata"

_MISSING = object()


class VllmMetadataProvider(MetadataProvider):
    """Forward metadata at ``ForwardContext.additional_kwargs["afd_metadata"]``.

    ``install`` sets it on the current forward context (if one is set) and, for
    the scope, wraps ``vllm.forward_context.create_forward_context`` so contexts
    created inside it (dummy runs, graph capture) carry it too; both are
    restored in ``finally``, also when the body raises, and installs nest.
    vLLM's forward context is per process, so this provider follows it (vLLM's
    own ubatch threads switch contexts with ``override_forward_context``).
    """

    name = "vllm"

    def __init__(self) -> None:
        self._fc: Any = None

    def _module(self) -> Any:
        if self._fc is None:
            import vllm.forward_context as fc

            self._fc = fc
        return self._fc

    @contextlib.contextmanager
    def install(self, metadata: ForwardMetadata) -> Iterator[ForwardMetadata]:
        fc = self._module()
        original = fc.create_forward_context

        def create_forward_context(*args: Any, **kwargs: Any) -> Any:
            ctx = original(*args, **kwargs)
            ctx.additional_kwargs[METADATA_KEY] = metadata
            return ctx

        ctx = fc.get_forward_context() if fc.is_forward_context_available() else None
        previous = _MISSING if ctx is None else ctx.additional_kwargs.get(METADATA_KEY, _MISSING)
        fc.create_forward_context = create_forward_context
        if ctx is not None:
            ctx.additional_kwargs[METADATA_KEY] = metadata
        try:
            yield metadata
        finally:
            fc.create_forward_context = original
            if ctx is not None:
                if previous is _MISSING:
                    ctx.additional_kwargs.pop(METADATA_KEY, None)
                else:
                    ctx.additional_kwargs[METADATA_KEY] = previous

    def current(self) -> ForwardMetadata | None:
        fc = self._module()
        if not fc.is_forward_context_available():
            return None
        return fc.get_forward_context().additional_kwargs.get(METADATA_KEY)
