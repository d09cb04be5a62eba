"""Run one AFD world of real processes on loopback and collect their results.

The launcher behind ``afd demo``, the benchmarks and the conformance kits.
Each rank is a fresh interpreter (``python -m <module> SPEC_JSON``, e.g.
``afd_sdk.runtime.worker``): the spawn start method without
multiprocessing's pickling. Specs go in as JSON on
argv, results come back as one JSON file per rank. Every process started here
is reaped before :func:`run_world` returns, also on timeout or error.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afd_sdk.runtime.zygote import active_zygote

__all__ = [
    "FAIL_FAST_S",
    "RankResult",
    "WorldResult",
    "free_port_block",
    "log_tail",
    "report_progress",
    "run_world",
    "worker_main",
]

logger = logging.getLogger(__name__)

#: the demos' and benchmarks' grace for the other ranks once one failed (``run_world(fail_fast_s=)``)
FAIL_FAST_S = 15.0
#: a rank still running when :func:`run_world` gives up gets this signal first: :func:`worker_main` ranks print
#: every thread's Python stack to their stderr (``faulthandler``), which the result then shows
STACK_DUMP_SIGNAL = signal.SIGUSR1
#: how long the stacks get to reach stderr before the rank is killed
STACK_DUMP_WAIT_S = 0.5


#: where :func:`free_port_block` looks when the kernel's ephemeral range cannot be read
_PORT_FLOOR, _PORT_CEILING = 20000, 65536


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections and ``bind(0)`` (``ip_local_port_range``), inclusive."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _port_bases(count: int) -> list[range]:
    """Where a block of ``count`` ports may start: outside the ephemeral range.

    Every outgoing TCP connection on the machine (ZMQ, Gloo, TCPStore clients of
    other worlds running in parallel) takes an ephemeral port; a block chosen
    inside that range can be taken between this check and the rank's ``bind``.
    """
    low, high = _ephemeral_ports()
    bases = [range(_PORT_FLOOR, low - count + 1), range(high + 1, _PORT_CEILING - count + 1)]
    bases = [r for r in bases if len(r)]
    return bases or [range(_PORT_FLOOR, _PORT_CEILING - count + 1)]


def free_port_block(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A base port ``p`` such that ``p .. p+count-1`` are all bindable on ``host`` now.

    The block lies outside the kernel's ephemeral range where there is room
    (see :func:`_port_bases`), so no outgoing connection takes one of its ports
    before the world binds it.
    """
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    bases = _port_bases(count)
    weights = [len(r) for r in bases]
    for _ in range(attempts):
        base = rng.choice(rng.choices(bases, weights)[0])
        socks = []
        try:
            for p in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {count} free ports on {host} after {attempts} attempts")


def log_tail(text: str, limit: int = 2000) -> str:
    """The end of a process's log, at most ``limit`` characters, cut at a line start (never mid-word), with
    how much was left out; a single line longer than ``limit`` keeps its end."""
    text = text.strip()
    if len(text) <= limit:
        return text
    tail = text[-limit:]
    nl = tail.find("\n")
    if 0 <= nl < len(tail) - 1:
        tail = tail[nl + 1 :]
    omitted = text[: len(text) - len(tail)].count("\n") + 1
    return f"[... {omitted} earlier line(s) omitted]\n{tail}"


@dataclass
class RankResult:
    role: str
    rank: int
    returncode: int | None
    result: dict[str, Any] = field(default_factory=dict)
    stderr: str = ""
    #: why the launcher killed this rank (``returncode`` is then ``None``): the timeout, or another rank's failure
    killed: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.result.get("status") == "ok"

    @property
    def error_type(self) -> str | None:
        return self.result.get("error_type")


@dataclass
class WorldResult:
    ranks: list[RankResult]

    def by_role(self, role: str) -> list[RankResult]:
        return [r for r in self.ranks if r.role == role]

    def describe(self) -> str:
        lines = []
        for r in self.ranks:
            killed = f" (killed: {r.killed})" if r.killed else ""
            lines.append(f"{r.role}[{r.rank}] rc={r.returncode}{killed} result={r.result}")
            if r.stderr.strip():
                # a killed rank's stderr ends with its stacks (STACK_DUMP_SIGNAL): room for a few threads
                tail = log_tail(r.stderr, 8000 if r.killed else 2000)
                lines.append("  stderr: " + tail.replace("\n", "\n  "))
        return "\n".join(lines)


def run_world(
    spec: Mapping[str, Any],
    *,
    module: str,
    per_rank: Mapping[tuple[str, int], Mapping[str, Any]] | None = None,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    roles: Sequence[str] = ("ffn", "attention"),
    on_progress: Callable[[str, int, dict[str, Any]], None] | None = None,
    fail_fast_s: float | None = None,
) -> WorldResult:
    """Start every rank of the world described by ``spec``; wait for all; return results.

    ``spec`` needs ``afd`` (the AFD mapping without ``role``) and ``scenario``;
    ``per_rank[(role, rank)]`` overrides keys for one rank. Each rank runs
    ``python -m <module> SPEC_JSON``; a role other than ``attention`` and
    ``ffn`` (a reference run, say) runs one rank. Ranks still running after ``timeout_s``
    are killed and reported with ``returncode=None``. ``on_progress(role, rank,
    event)`` receives the events workers emit with :func:`report_progress`.

    With ``fail_fast_s``, the first rank that exits with an error gives the
    others ``fail_fast_s`` seconds to report (they usually raise
    ``PeerLostError`` on their own), then they are killed: a demo or a
    benchmark whose rank fails at start-up ends then, not after the world's
    whole timeout. The conformance kits leave it off: their survivors must
    report how they noticed.
    """
    afd = spec["afd"]
    counts = {"attention": int(afd.get("num_attention_ranks", 1)), "ffn": int(afd.get("num_ffn_ranks", 1))}
    per_rank = per_rank or {}
    procs: list[tuple[str, int, Any, Path, Any]] = []
    child_env = {**os.environ, **(env or {})}
    failed_at: float | None = None  # when the first rank exited with an error (fail_fast_s)
    with tempfile.TemporaryDirectory(prefix="afd-world-") as tmp:
        try:
            for role in roles:
                for rank in range(counts.get(role, 1)):
                    rank_spec = {**spec, **per_rank.get((role, rank), {}), "role": role, "rank": rank}
                    out = Path(tmp) / f"{role}{rank}.json"
                    rank_spec["result_path"] = str(out)
                    rank_spec["progress_path"] = str(Path(tmp) / f"{role}{rank}.progress")
                    err = tempfile.TemporaryFile()
                    p = _start_rank(module, json.dumps(rank_spec), child_env, err)
                    procs.append((role, rank, p, out, err))
            deadline = time.monotonic() + timeout_s
            offsets: dict[tuple[str, int], int] = {}
            while time.monotonic() < deadline and any(p.poll() is None for _, _, p, _, _ in procs):
                time.sleep(0.05)
                if on_progress is not None:
                    _poll_progress(tmp, procs, offsets, on_progress)
                if fail_fast_s is not None and failed_at is None and any(p.poll() for _, _, p, _, _ in procs):
                    failed_at = time.monotonic()
                    deadline = min(deadline, failed_at + fail_fast_s)
            if on_progress is not None:
                _poll_progress(tmp, procs, offsets, on_progress)
        finally:
            stuck = [p for _, _, p, _, _ in procs if p.poll() is None]
            timed_out = {p.pid for p in stuck}
            _dump_stacks(stuck)
            for p in stuck:
                _kill_group(p)
            why = "another rank failed" if failed_at is not None else f"still running after {timeout_s:g}s"
            results = []
            for role, rank, p, out, err in procs:
                err.seek(0)
                stderr = err.read().decode(errors="replace")
                err.close()
                data = json.loads(out.read_text()) if out.exists() else {}
                killed = p.pid in timed_out
                results.append(
                    RankResult(role, rank, None if killed else p.returncode, data, stderr, killed=why if killed else "")
                )
    return WorldResult(results)


def _start_rank(module: str, spec_json: str, env: dict[str, str], stderr: Any) -> Any:
    """``python -m module SPEC_JSON`` in a session of its own: forked from the warm-worker zygote where one is
    enabled and can run it faithfully (:mod:`afd_sdk.runtime.zygote`), else a fresh interpreter."""
    zygote = active_zygote()
    if zygote is not None and zygote.eligible(module, env):
        try:
            return zygote.spawn(module, [spec_json], env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        except (OSError, RuntimeError, ValueError) as exc:  # TimeoutError is an OSError
            logger.warning("warm-worker zygote failed (%s); starting %s cold", exc, module)
    return subprocess.Popen(
        [sys.executable, "-m", module, spec_json],
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        env=env,
        start_new_session=True,
    )


def _poll_progress(
    tmp: str, procs: list[Any], offsets: dict[tuple[str, int], int], cb: Callable[[str, int, dict[str, Any]], None]
) -> None:
    for role, rank, _, _, _ in procs:
        path = Path(tmp) / f"{role}{rank}.progress"
        if not path.exists():
            continue
        with path.open() as fh:
            fh.seek(offsets.get((role, rank), 0))
            chunk = fh.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            offsets[(role, rank)] = offsets.get((role, rank), 0) + len(complete)
        for line in complete.splitlines():
            cb(role, rank, json.loads(line))


def report_progress(spec: Mapping[str, Any], **event: Any) -> None:
    """Worker side: emit one progress event to the parent's ``on_progress``."""
    path = spec.get("progress_path")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(event) + "\n")


def worker_main(run: Callable[[dict[str, Any], dict[str, Any]], None], argv: Sequence[str]) -> int:
    """Entry of a world worker: ``run(spec, out)`` fills ``out``, written as JSON with a status.

    Any exception adds ``status="error"``, ``error_type``, ``error_message`` and
    ``traceback`` to what ``out`` already holds, and exits 1, so the parent can
    report it without parsing stderr.
    """
    import faulthandler
    import traceback

    # a rank the launcher gives up on shows where it was (its stderr is in the result); the default action of
    # this signal would be to die without a word
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
    spec = json.loads(argv[1])
    out: dict[str, Any] = {"status": "ok"}
    code = 0
    try:
        run(spec, out)
    except Exception as exc:
        out.update(
            status="error", error_type=type(exc).__name__, error_message=str(exc), traceback=traceback.format_exc()
        )
        code = 1
    with open(spec["result_path"], "w") as fh:
        json.dump(out, fh)
    return code


def _dump_stacks(procs: Sequence[Any]) -> None:
    """Ask each of ``procs`` for its threads' Python stacks (on its stderr), once, and give them time to write."""
    asked = 0
    for p in procs:
        try:
            os.kill(p.pid, STACK_DUMP_SIGNAL)
            asked += 1
        except ProcessLookupError:  # it ended meanwhile
            continue
    if asked:
        time.sleep(STACK_DUMP_WAIT_S)


def _kill_group(p: Any) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=10)
