"""Both roles in one process, for tests that drive a connector (or control plane) pair call by call."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

__all__ = ["init_in_threads"]


class _Initialisable(Protocol):
    def init(self) -> None: ...


def init_in_threads(ffn: _Initialisable, attention: Sequence[_Initialisable], timeout_s: float = 30.0) -> None:
    """``init()`` an FFN-side object and its attention peers together: the peers in threads, the FFN here.

    Their rendezvous needs both sides at once, as in separate processes.
    Raises the first error of any side (the FFN's first), or ``TimeoutError``
    naming the peers that did not finish within ``timeout_s``.
    """
    errors: list[BaseException] = []

    def run(obj: _Initialisable) -> None:
        try:
            obj.init()
        except BaseException as exc:  # re-raised in the caller's thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(a,), name=f"init-attention{i}") for i, a in enumerate(attention)]
    for t in threads:
        t.start()
    try:
        ffn.init()
    finally:
        for t in threads:
            t.join(timeout_s)
    if errors:
        raise errors[0]
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        raise TimeoutError(f"{', '.join(stuck)} did not finish init() within {timeout_s:g}s")
