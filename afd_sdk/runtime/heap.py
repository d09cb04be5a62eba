"""Keep the garbage collector's full collections off the exchange path of a serving process.

A process that serves a split model holds everything it loaded (modules, the
model, the connector) until it exits, and CPython's full collection scans all
of it: 80 ms over the 172k objects of an ``afd bench connector`` rank,
measured with ``gc.callbacks``, and in proportion more for a real model. The
collection runs wherever the allocation that triggers it happens, which in a
serving loop is some layer's exchange. Freezing what exists once loading is
done moves it out of every later collection (``gc.freeze``), as vLLM's engine
does after its start-up; what the loop allocates afterwards is collected as
before.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object left; returns how many are frozen.

    Called by a process entry point (the ``afd`` role commands, the demo's
    workers, the benchmark ranks) once its model is loaded and its connector
    initialised, before the first exchange. Not for library code that may run
    inside a longer-lived process (a test session): frozen objects are never
    collected, so cyclic garbage among them would stay.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
