"""Real ``vllm serve`` / ``afd ffn serve`` processes for the serving tests: start, wait healthy, stop, clean up."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from afd_sdk.integrations.vllm.demo import WORLD_ENV
from afd_sdk.integrations.vllm.server_process import ServerExitedError, ServerProcess

BIN = Path(sys.executable).parent
#: every server of the tier: multiprocess engine (vLLM's default for `vllm serve`), 1 GiB KV cache, one OpenMP
#: thread (the machine's 2 cores are shared by five processes), loopback only, afd-sdk's plugin only
SERVE_ENV = {
    **WORLD_ENV,
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    "VLLM_PLUGINS": "afd",
    "VLLM_LOGGING_LEVEL": "INFO",
    # UCX (the NIXL cases) picks every interface it finds unless told; the tier's worlds are on loopback
    "UCX_NET_DEVICES": "lo",
}
#: small on purpose: 4 running sequences, 32 tokens per step -> chunked prefill mixed with decodes
ENGINE = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 32, "seed": 0}


def multiprocessing_segments() -> set[str]:
    """Python multiprocessing's shared-memory segments and semaphores in ``/dev/shm`` (vLLM's message queues)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("*") if p.name.startswith(("psm_", "sem.mp-"))} if shm.is_dir() else set()


def mapped_segments() -> set[str]:
    """Names of ``/dev/shm`` files some live process maps now (``/proc/*/maps``)."""
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):  # the process ended, or is not ours to read
            for line in maps.read_text().splitlines():
                at = line.find("/dev/shm/")
                if at >= 0:
                    names.add(line[at + len("/dev/shm/") :].removesuffix(" (deleted)"))
    return names


#: how long :func:`remove_segments` waits for the last mapper of a left segment to exit
SEGMENT_RELEASE_S = 30.0


def remove_segments(names: set[str]) -> None:
    """Unlink segments left by processes that were killed (they cannot unlink their own); never one in use.

    A killed engine's worker process still maps its rings for a while after the tier's servers have stopped
    (CI runs left two vLLM rings, 240 and 160 MiB, behind): wait up to :data:`SEGMENT_RELEASE_S` for every
    mapper to exit, then unlink what no live process maps."""
    deadline = time.monotonic() + SEGMENT_RELEASE_S
    while names & mapped_segments() and time.monotonic() < deadline:
        time.sleep(0.5)
    for name in names - mapped_segments():
        with contextlib.suppress(FileNotFoundError):
            (Path("/dev/shm") / name).unlink()


class Server(ServerProcess):
    """A tier server: :class:`~afd_sdk.integrations.vllm.server_process.ServerProcess` with the tier's environment
    (``SERVE_ENV``, this interpreter's bin first on ``PATH``); ``AssertionError`` when it is not healthy in time."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, *, http_port: int | None = None) -> None:
        env = {**SERVE_ENV, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        super().__init__(name, argv, log_dir, http_port=http_port, env=env)

    def wait_healthy(self, timeout_s: float) -> float:
        try:
            return super().wait_healthy(timeout_s)
        except ServerExitedError as exc:
            raise AssertionError(str(exc)) from None
