"""``afd bench connector --profile``: where one round trip's time goes, connector and raw side by side.

Each rank times its own calls in a block of round trips, for the connector and
for every raw baseline, in the same processes as the timed columns:

* **per call** (connector only; a raw round trip is one closure): wall time,
  on-CPU time of the calling thread (``thread_time``) and the difference, the
  time the thread was off the CPU (waiting for the peer, or preempted);
* **per round trip**: CPU of the calling thread, CPU of the whole process
  (the rest is background threads: ZMQ's I/O thread, pyzmq's zero-copy
  garbage thread, Gloo's workers), voluntary context switches (the thread
  slept) and involuntary ones (it was preempted);
* **functions**: one more block under ``cProfile``, the top functions by own
  time per round trip — header build and parse, copies, socket calls. The
  profiler inflates Python time, so compare connector with raw here, not with
  the timed table;
* **wake penalty**: how much slower the same Python work runs right after the
  thread slept 200 µs than in a hot loop. Every exchange runs its Python right
  after a wait, so a connector's per-message Python costs this many times its
  hot-loop cost (the VM and power-state effect the raw loop, with almost no
  Python, barely feels).
"""

from __future__ import annotations

import cProfile
import pstats
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["profile_attention", "profile_ffn", "wake_penalty"]

TOP_FUNCTIONS = 10


class _Usage:
    """Thread CPU, process CPU and the thread's context switches across one block."""

    def __init__(self) -> None:
        self.cpu = time.thread_time_ns()
        self.proc = time.process_time_ns()
        self.ru = resource.getrusage(resource.RUSAGE_THREAD)

    def per(self, count: int) -> dict[str, float]:
        cpu, proc = time.thread_time_ns() - self.cpu, time.process_time_ns() - self.proc
        ru = resource.getrusage(resource.RUSAGE_THREAD)
        return {
            "thread_cpu_us": cpu / count / 1000,
            "process_cpu_us": proc / count / 1000,
            "background_cpu_us": max(0.0, (proc - cpu) / count / 1000),
            "voluntary_switches": (ru.ru_nvcsw - self.ru.ru_nvcsw) / count,
            "involuntary_switches": (ru.ru_nivcsw - self.ru.ru_nivcsw) / count,
            "page_faults": (ru.ru_minflt - self.ru.ru_minflt) / count,
        }


def _functions(prof: cProfile.Profile, count: int) -> list[dict[str, Any]]:
    """The top functions by own time, per round trip: ``{"function", "own_us", "calls"}``."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = []
    for (path, line, func), (_cc, calls, tottime, _ct, _callers) in stats.items():
        # a builtin ("~") is named by itself; Python code by its last two path parts, line and name
        name = func if path == "~" else f"{'/'.join(path.rsplit('/', 2)[-2:])}:{line}({func})"
        rows.append({"function": name, "own_us": tottime * 1e6 / count, "calls": calls / count})
    rows.sort(key=lambda r: -r["own_us"])
    return [r for r in rows[:TOP_FUNCTIONS] if r["own_us"] >= 0.05]


def _under_profile(fn: Callable[[], None]) -> cProfile.Profile:
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    return prof


def _timed_pairs(
    first: Callable[[int], Any], second: Callable[[Any], None], count: int, between: Callable[[], None] | None = None
) -> tuple[dict[str, Any], list[float], float]:
    """``count`` times ``second(first(i))``, each call timed; then ``between()`` (a connector's next step) and the
    same ``i`` once more under cProfile.

    Returns the per-trip accounting (:class:`_Usage`) with ``functions``, the
    medians of (first wall, first CPU, second wall, second CPU) in µs, and the
    median of the two walls together.
    """
    wall = time.perf_counter_ns
    cpu = time.thread_time_ns
    parts: list[tuple[int, int, int, int]] = []
    usage = _Usage()
    for i in range(count):
        t0, c0 = wall(), cpu()
        got = first(i)
        t1, c1 = wall(), cpu()
        second(got)
        t2, c2 = wall(), cpu()
        parts.append((t1 - t0, c1 - c0, t2 - t1, c2 - c1))
    out: dict[str, Any] = usage.per(count)
    medians = [statistics.median(p[j] for p in parts) / 1000 for j in range(4)]
    both = statistics.median(p[0] + p[2] for p in parts) / 1000

    def again() -> None:  # the same indices as the timed half: both see the steady state (plans built, caches hot)
        for i in range(count):
            second(first(i))

    if between is not None:
        between()

    out["functions"] = _functions(_under_profile(again), count)
    return out, medians, both


def profile_attention(
    send: Callable[[int], None], recv: Callable[[], None] | None, count: int, between: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Attention rank: ``count`` round trips of ``send(i)`` then ``recv()``; timed, then once more under cProfile.

    A raw baseline passes its round trip as ``send`` and ``recv=None``: it is
    timed as one call. The caller runs two warm-up round trips first. A
    connector passes ``between``, which announces the step the profiled block
    runs in: a connector that counts layers per step then sees the layer
    numbers of the timed block again, whose plans exist.
    """
    out, med, both = _timed_pairs(send, (lambda _: None) if recv is None else (lambda _: recv()), count, between)
    out["rt_us"] = both
    if recv is not None:
        out.update(send_us=med[0], send_cpu_us=med[1], recv_us=med[2], recv_cpu_us=med[3])
    return out


def profile_ffn(
    recv: Callable[[], Any] | None,
    send: Callable[[Any], None] | None,
    echo: Callable[[int], None] | None,
    count: int,
    between: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """FFN rank: the mirror of :func:`profile_attention` (``recv`` then ``send`` per message, or a raw ``echo``;
    ``between`` takes the step the attention rank's ``between`` announced)."""
    if echo is not None:
        usage = _Usage()
        echo(count)
        out = usage.per(count)
        out["functions"] = _functions(_under_profile(lambda: echo(count)), count)
        return out
    assert recv is not None and send is not None
    out, med, _ = _timed_pairs(lambda _i: recv(), send, count, between)
    out.update(recv_us=med[0], recv_cpu_us=med[1], send_us=med[2], send_cpu_us=med[3])
    return out


def _python_work() -> int:
    x = torch.empty(0)
    s = 0
    for i in range(64):
        s += i
    return s + x.dim()


def wake_penalty(sleep_s: float = 200e-6, n: int = 400) -> dict[str, float]:
    """Median time of a fixed bit of Python (a loop and a torch call) hot, and right after sleeping ``sleep_s``."""

    def median_after(gap: float) -> float:
        samples = []
        for _ in range(n):
            if gap:
                time.sleep(gap)
            t0 = time.perf_counter_ns()
            _python_work()
            samples.append(time.perf_counter_ns() - t0)
        return statistics.median(samples) / 1000

    median_after(0.0)
    hot = median_after(0.0)
    cold = median_after(sleep_s)
    return {"hot_us": hot, "after_sleep_us": cold, "sleep_us": sleep_s * 1e6, "ratio": cold / hot}
