"""Waiting for FFN ranks' parts of an exchange while watching their heartbeats (redundant experts only).

A Gloo wait cannot be cut short: a timed-out wait closes every connection of the waiting rank (gloo's
"Application timeout caused pair closure"), so an attention rank that waited for a frozen FFN rank with the
plain ``timeout_s`` deadline would lose the whole world, the FFN ranks that could take over included. With
``expert_replicas`` > 1 an attention rank therefore waits on a thread of its own, with no practical deadline,
while the caller watches the heartbeats (:mod:`afd_connectors.cam.liveness`): a part whose FFN rank stops
beating is given up (the caller re-dispatches it elsewhere), and a thread stuck in that rank's wait is left to
it (it ends when the rank's connection closes) while a fresh thread takes the remaining parts.

Cost on the fault-free path: one hand-off to the thread and one wake-up per combine.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from afd_sdk.errors import PeerLostError

if TYPE_CHECKING:
    from afd_connectors.cam.liveness import StoreHeartbeat

__all__ = ["WatchedWaiter"]

#: the Gloo deadline of a watched wait: the heartbeats end it long before (a year; gloo counts milliseconds)
_FOREVER = datetime.timedelta(days=365)


class _Job:
    """One call's parts, shared by the caller and the thread that waits them (under ``lock``)."""

    def __init__(self, parts: Sequence[tuple[int, Sequence[Any]]], what: str, what_args: tuple[object, ...]) -> None:
        self.parts = list(parts)
        self.what, self.what_args = what, what_args
        self.lock = threading.Lock()
        self.current: int | None = None  # index of the part being waited
        self.finished: set[int] = set()  # indices waited (completed or failed)
        self.skip: set[int] = set()  # indices given up: the thread must not touch them
        self.errors: dict[int, str] = {}  # index -> why it failed
        self.abandoned = False  # the thread is stuck in a given-up part: it drops the job when that wait returns
        self.done = threading.Event()


class WatchedWaiter:
    """Waits ``(ffn rank, works)`` parts in order on a daemon thread; owned by one backend, used by one caller."""

    def __init__(self, owner: str, liveness: StoreHeartbeat, num_attention: int, timeout_s: float) -> None:
        self._owner = owner
        self._liveness = liveness
        self._num_attention = num_attention
        self._timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[_Job | None] | None = None

    def close(self) -> None:
        """Let the thread exit after its current job (a stuck one exits when its wait returns)."""
        jobs, self._jobs = self._jobs, None
        if jobs is not None:
            jobs.put(None)

    def wait_parts(self, parts: Sequence[tuple[int, Sequence[Any]]], what: str, *what_args: object) -> dict[int, str]:
        """Wait every part; return ``{ffn rank: why}`` for those that failed or whose rank stopped beating.

        ``what % what_args`` names the wait; it is formatted only when something fails.

        ``PeerLostError`` when the parts are not all done within ``timeout_s`` of the call (or of the last part
        given up) while every rank still beats (a rank alive but not answering: nothing to route around).
        """
        failed: dict[int, str] = {}
        job = self._submit(parts, what, what_args)
        deadline = time.monotonic() + self._timeout_s
        while True:
            if job.done.wait(self._liveness.period_s):
                for i, why in job.errors.items():
                    failed[job.parts[i][0]] = why
                return failed
            lost = {rank - self._num_attention for rank in self._liveness.lost_ranks()}
            with job.lock:
                given_up = {i for i, (f, _works) in enumerate(job.parts) if f in lost and i not in job.finished}
                job.skip |= given_up
                stuck = job.current in given_up
                if stuck:
                    job.abandoned = True
                    rest = [p for i, p in enumerate(job.parts) if i not in job.finished and i not in job.skip]
            for i in given_up:
                failed[job.parts[i][0]] = (
                    f"no heartbeat through {self._liveness.address} while waiting for {what % what_args}"
                )
            if given_up:
                deadline = time.monotonic() + self._timeout_s
            if stuck:  # a fresh thread for the rest; the stuck one ends with its rank's connection
                self.close()
                with job.lock:
                    errors = dict(job.errors)
                for i, why in errors.items():
                    failed[job.parts[i][0]] = why
                job = self._submit(rest, what, what_args)
            elif time.monotonic() > deadline:
                pending = [f for i, (f, _works) in enumerate(job.parts) if i not in job.finished]
                raise PeerLostError(
                    f"{self._owner}: ffn ranks {pending} still beat but did not complete {what % what_args} within "
                    f"afd.timeout_s={self._timeout_s:g}s"
                )

    def _submit(self, parts: Sequence[tuple[int, Sequence[Any]]], what: str, what_args: tuple[object, ...]) -> _Job:
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            name = f"afd-cam-wait-{self._owner}"
            threading.Thread(target=self._run, args=(self._jobs,), name=name, daemon=True).start()
        job = _Job(parts, what, what_args)
        self._jobs.put(job)
        return job

    @staticmethod
    def _run(jobs: queue.SimpleQueue[_Job | None]) -> None:
        while (job := jobs.get()) is not None:
            for i, (_ffn, works) in enumerate(job.parts):
                with job.lock:
                    if job.abandoned:
                        return
                    if i in job.skip:
                        continue
                    job.current = i
                try:
                    for work in works:
                        work.wait(_FOREVER)
                except RuntimeError as exc:  # its connection closed: gloo says so at once
                    with job.lock:
                        job.errors[i] = f"{job.what % job.what_args} failed: {exc}"
                with job.lock:
                    job.current = None
                    job.finished.add(i)
                    if job.abandoned:
                        return
            job.done.set()
