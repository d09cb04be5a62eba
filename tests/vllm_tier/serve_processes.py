"""Real ``vllm serve`` / ``afd ffn serve`` processes for the serving tests: start, wait healthy, stop, clean up."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from afd_sdk.integrations.vllm.demo import WORLD_ENV

BIN = Path(sys.executable).parent
#: every server of the tier: multiprocess engine (vLLM's default for `vllm serve`), 1 GiB KV cache, one OpenMP
#: thread (the machine's 2 cores are shared by five processes), loopback only, afd-sdk's plugin only
SERVE_ENV = {**WORLD_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_PLUGINS": "afd", "VLLM_LOGGING_LEVEL": "INFO"}
#: small on purpose: 4 running sequences, 32 tokens per step -> chunked prefill mixed with decodes
ENGINE = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 32, "seed": 0}


def multiprocessing_segments() -> set[str]:
    """Python multiprocessing's shared-memory segments and semaphores in ``/dev/shm`` (vLLM's message queues)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("*") if p.name.startswith(("psm_", "sem.mp-"))} if shm.is_dir() else set()


def remove_segments(names: set[str]) -> None:
    """Unlink segments left by processes that were killed (they cannot unlink their own)."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (Path("/dev/shm") / name).unlink()


class Server:
    """One server process in its own process group (so its engine and worker processes go with it)."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, *, http_port: int | None = None) -> None:
        self.name = name
        self.argv = argv
        self.http_port = http_port
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("w")
        env = {**os.environ, **SERVE_ENV, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.started = time.monotonic()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self, tail: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-tail:]

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds from start until ``/health`` answers; ``AssertionError`` with the log if it does not."""
        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited with {self.proc.returncode} before it was healthy:\n{self.log()}"
                )
            if self.healthy():
                return time.monotonic() - self.started
            time.sleep(0.5)
        raise AssertionError(f"{self.name} not healthy within {timeout_s:g}s:\n{self.log()}")

    def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGTERM the group, then SIGKILL what is left after 20 s: nothing outlives the test."""
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)
        with contextlib.suppress(ProcessLookupError):  # the group's stragglers (engine core, worker)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
