"""Broken variants of CAMAsyncAFDConnector that the async-dispatch suite must fail (test_conformance_catches_broken).

Loaded by the suite's worker processes through ``connector_target`` (this directory on ``PYTHONPATH``).
"""

from __future__ import annotations

from typing import Any

from afd_connectors.cam.connector import CAMAsyncAFDConnector
from afd_connectors.cam.portable import PortableCamBackend
from afd_sdk.control import wait_works


class DeadlineBetweenSteps(CAMAsyncAFDConnector):
    """CAM before its liveness: no heartbeats, so the FFN waits for the next step with the plain deadline."""

    def open(self) -> None:
        self.backend.init()


class _WaitForever(PortableCamBackend):
    def _wait_between_steps(self, works: list[Any], stage: int) -> None:
        wait_works(works, 3600.0, "next step, with no liveness")


class NoLivenessBetweenSteps(CAMAsyncAFDConnector):
    """Waits out any pause between steps, a frozen peer's too: it never notices that a peer is gone."""

    def _make_backend(self) -> Any:
        return _WaitForever(self)
