"""Forward metadata: what model code may read during one forward pass.

The runner *installs* metadata around each forward through a
:class:`MetadataProvider`; the FFN proxy inside each decoder layer reads it
with :meth:`MetadataProvider.current`. The model never initialises or closes
the connector it finds there.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from afd_sdk.errors import AFDConfigError

__all__ = ["ContextVarMetadataProvider", "ForwardMetadata", "MetadataProvider"]


@dataclass(frozen=True)
class ForwardMetadata:
    """Per-forward facts for the FFN proxy of every layer.

    Offsets index the step's flattened token batch. ``stage_token_len_padded``
    equals ``stage_token_len`` unless the runner pads (graph capture).
    ``request_start[s]`` is the first request index of stage ``s``.
    """

    stage_idx: int
    num_stages: int
    stage_token_start: tuple[int, ...]
    stage_token_len: tuple[int, ...]
    stage_token_len_padded: tuple[int, ...]
    request_start: tuple[int, ...]
    #: the step's connector (an ``AFDConnector`` or ``AsyncDispatchConnector``); typed loosely so the
    #: metadata contract depends on no connector contract
    connector: Any
    transaction_id: int | None = None

    def __post_init__(self) -> None:
        n = self.num_stages
        if n < 1 or not 0 <= self.stage_idx < n:
            raise AFDConfigError(
                f"ForwardMetadata.stage_idx={self.stage_idx} with num_stages={n}; expected 0 <= stage_idx < num_stages",
                key="stage_idx",
                value=self.stage_idx,
            )
        for name in ("stage_token_start", "stage_token_len", "stage_token_len_padded", "request_start"):
            seq = getattr(self, name)
            if len(seq) != n:
                raise AFDConfigError(
                    f"ForwardMetadata.{name} has {len(seq)} entries; expected num_stages={n}", key=name, value=seq
                )
        for unpadded, padded in zip(self.stage_token_len, self.stage_token_len_padded, strict=True):
            if padded < unpadded:
                raise AFDConfigError(
                    f"ForwardMetadata.stage_token_len_padded={self.stage_token_len_padded} is below "
                    f"stage_token_len={self.stage_token_len}",
                    key="stage_token_len_padded",
                    value=self.stage_token_len_padded,
                )

    @property
    def num_tokens(self) -> int:
        """Unpadded tokens of the current stage."""
        return self.stage_token_len[self.stage_idx]


class MetadataProvider(abc.ABC):
    """Where forward metadata lives while a forward runs.

    The runner calls :meth:`install` around each stage's forward; model code
    calls :meth:`current`. Implementations must keep threads apart: two
    micro-batch threads each see the metadata they installed.
    """

    name: str = ""

    @abc.abstractmethod
    def install(self, metadata: ForwardMetadata) -> contextlib.AbstractContextManager[ForwardMetadata]:
        """Context manager making ``metadata`` current; restores the previous state on exit,
        including when the body raises. Nests."""

    @abc.abstractmethod
    def current(self) -> ForwardMetadata | None:
        """The installed metadata of this thread/context, or ``None`` outside any forward."""


_CURRENT: contextvars.ContextVar[ForwardMetadata | None] = contextvars.ContextVar("afd_forward_metadata", default=None)


class ContextVarMetadataProvider(MetadataProvider):
    """Built-in provider on a ``contextvars.ContextVar``.

    A new thread starts with an empty context, so each micro-batch thread sees
    only what it installed itself.
    """

    name = "contextvar"

    @contextlib.contextmanager
    def install(self, metadata: ForwardMetadata) -> Iterator[ForwardMetadata]:
        token = _CURRENT.set(metadata)
        try:
            yield metadata
        finally:
            _CURRENT.reset(token)

    def current(self) -> ForwardMetadata | None:
        return _CURRENT.get()
