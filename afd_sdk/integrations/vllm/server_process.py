"""One server process (``vllm serve``, ``afd ffn serve``) with its log: start, wait healthy, stop with its group.

Used by ``afd bench serve`` and the serving tests: each server runs in its own
session (process group), so stopping it stops vLLM's engine-core and worker
processes too, and nothing outlives the caller.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from afd_sdk.errors import AFDError

__all__ = ["ServerExitedError", "ServerProcess"]


class ServerExitedError(AFDError):
    """A server exited, or did not answer ``/health``, before it was healthy (the message carries its log)."""


class ServerProcess:
    """``argv`` started in its own process group, output to ``<log_dir>/<name>.log``.

    ``http_port``: where ``/health`` answers (``None`` for a server without one,
    e.g. an FFN server without ``--metrics-port``). ``env`` is added to this
    process's environment.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        *,
        http_port: int | None = None,
        env: Mapping[str, str] | None = None,
        health_path: str = "/health",
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.http_port = http_port
        self.health_path = health_path
        self.log_path = Path(log_dir) / f"{name}.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.started = time.monotonic()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self, tail: int = 4000) -> str:
        """The last ``tail`` characters of the server's output."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-tail:]

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}{self.health_path}", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float) -> float:
        """Until the health path answers 200, at most ``timeout_s`` from this call; returns seconds since start.

        :class:`ServerExitedError` when the server exits first or the time runs out. A server that is healthy
        already returns at once, however long ago it started.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerExitedError(
                    f"{self.name} exited with {self.proc.returncode} before it was healthy:\n{self.log()}"
                )
            if self.healthy():
                return time.monotonic() - self.started
            if time.monotonic() >= deadline:
                raise ServerExitedError(f"{self.name} not healthy within {timeout_s:g}s:\n{self.log()}")
            time.sleep(0.5)

    def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the group, SIGKILL what is left after ``grace_s``; then the group's stragglers."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)
        with contextlib.suppress(ProcessLookupError):  # engine core and workers left in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
