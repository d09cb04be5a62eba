"""The runtime's step, simulated: every rank's per-layer, per-micro-batch work on shared cores.

Each attention rank runs its micro-batches in the runner's order (layer by layer, stage 0 to ``S-1``); the
attention of micro-batch ``j`` at layer ``l`` waits for its FFN output of layer ``l-1``. Each FFN rank serves
``(l, j)`` in the same order once every attention rank that feeds it has sent that micro-batch (fan-in: its
block of ranks, :func:`afd_sdk.topology.even_blocks`; routed: all of them). A message takes half a round trip
each way as a delay; an FFN rank answering several ranks spends ``extra_message_us`` of CPU on each message
beyond the first. The FFN's batch grows with the ranks it batches, which the caller's ``ffn_us`` already reflects.

The cores are shared by processor sharing: ``n`` runnable tasks on ``C`` cores each progress at
``min(1, C/n) / k(n)``, where ``k`` is the measured slowdown of ``min(n, C)`` processes computing at once
(hyper-threads and memory bandwidth make two busy cores slower than one: ``Host.concurrency_slowdown``).
Fill and drain come out of the schedule; nothing is assumed about overlap.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from afd_sdk.topology import even_blocks

__all__ = ["Schedule", "simulate_step"]


@dataclass(frozen=True)
class Schedule:
    """The simulated step: its length and the work of each role's busiest rank, at full speed (microseconds)."""

    step_us: float
    attention_busy_us: float
    ffn_busy_us: float
    #: the most attention ranks one FFN rank serves (its fan-in block, or all of them with routed dispatch)
    largest_group: int


def simulate_step(
    *,
    attention: int,
    ffn: int,
    stages: int,
    layers: int,
    attention_us: float,
    ffn_us: Callable[[int], float],
    round_trip_us: float,
    extra_message_us: float,
    routed: bool,
    cores: float,
    slowdown: Callable[[int], float],
) -> Schedule:
    """Simulate one step (without its fixed overhead). ``ffn_us(g)`` is the work per layer and micro-batch of an
    FFN rank fed by ``g`` attention ranks; ``slowdown(n)`` the factor for ``n`` processes computing at once
    (``n <= cores``); ``extra_message_us`` an FFN rank's CPU per message beyond the first."""
    feeds = [tuple(range(attention))] * ffn if routed else [tuple(range(a, b)) for a, b in even_blocks(attention, ffn)]
    feeds_of = [[f for f in range(ffn) if r in feeds[f]] for r in range(attention)]
    half = round_trip_us / 2
    # queues: per process, its tasks in order, as (kind, rank, layer, stage)
    procs: list[list[tuple[str, int, int, int]]] = []
    work: dict[tuple[str, int, int, int], float] = {}
    for r in range(attention):
        q = [("a", r, layer, j) for layer in range(layers) for j in range(stages)]
        procs.append(q)
        for t in q:
            work[t] = attention_us
    for f in range(ffn):
        if not feeds[f]:
            continue
        q = [("f", f, layer, j) for layer in range(layers) for j in range(stages)]
        procs.append(q)
        per = ffn_us(len(feeds[f])) + (len(feeds[f]) - 1) * extra_message_us
        for t in q:
            work[t] = per
    done: dict[tuple[str, int, int, int], float] = {}

    def ready_at(t: tuple[str, int, int, int]) -> float:
        kind, rank, layer, j = t
        if kind == "a":
            if layer == 0:
                return 0.0
            deps = [("f", f, layer - 1, j) for f in feeds_of[rank]]
        else:
            deps = [("a", r, layer, j) for r in feeds[rank]]
        if any(d not in done for d in deps):
            return math.inf
        return max(done[d] for d in deps) + half

    heads = [0] * len(procs)
    remaining = {t: w for t, w in work.items()}
    busy = [0.0] * len(procs)
    now = 0.0
    for _ in range(10 * len(work) + 10):  # each pass finishes a task or reaches a release time
        live = [i for i, q in enumerate(procs) if heads[i] < len(q)]
        if not live:
            break
        ready = {i: ready_at(procs[i][heads[i]]) for i in live}
        runnable = [i for i in live if ready[i] <= now + 1e-9]
        if not runnable:
            nxt = min(ready.values())
            if math.isinf(nxt):
                raise RuntimeError("the simulated schedule deadlocked")  # a bug in the dependencies, not the input
            now = nxt
            continue
        n = len(runnable)
        rate = min(1.0, cores / n) / slowdown(min(n, math.ceil(cores)))
        finish = min(remaining[procs[i][heads[i]]] / rate for i in runnable)
        release = min((ready[i] - now for i in live if ready[i] > now + 1e-9), default=math.inf)
        dt = min(finish, release)
        for i in runnable:
            t = procs[i][heads[i]]
            remaining[t] -= rate * dt
            busy[i] += rate * dt  # work done (at full speed), not wall time spent runnable on shared cores
        now += dt
        for i in runnable:
            t = procs[i][heads[i]]
            if remaining[t] <= 1e-9:
                done[t] = now
                heads[i] += 1
    else:
        raise RuntimeError("the simulated schedule did not finish")  # bounded loop: a bug, not the input
    last = max(done[("f", f, layers - 1, j)] for f in range(ffn) if feeds[f] for j in range(stages))
    return Schedule(
        step_us=last + half,
        attention_busy_us=max(busy[:attention]),
        ffn_busy_us=max(busy[attention:], default=0.0),
        largest_group=max(len(f) for f in feeds),
    )
