"""The adaptive spin of the shared-memory waits: the state the native wait reads and updates.

A waiting side of ``ShmAFDConnector`` (and its raw ring in ``afd bench``) spins before it
blocks on a futex. The native wait (``_shmring_core.h``) adapts that spin after every wait:
a wait that slept and still ended within ``max`` raises the spin to cover such a wait, a
wait that ran past ``max`` (the peer was computing, not answering) puts it back to
``base``, and waits that end well inside the spin let it decay toward ``base``. Why:
a futex wake-up costs 60–95 µs on a 2-vCPU VM, and once one side sleeps through an
answer both sides fall into two wake-ups per round trip and stay there.

The state is three int64s (base, max and current budget, in ns) in memory this object
owns, so the C and C++ halves of the connector share one estimate by address.

The adaptive range pays only where the waiting side has a core to spare: it raises the
spin to cover a peer that answers within ``max``, and a peer *computing* for a few
hundred µs (an FFN layer on CPU) is such a peer. On a host whose cores the engine, its
API server and the FFN server share, that spin takes the core the peer computes on.
So ``spin_max_us`` left out of the config means :data:`ADAPTIVE_MAX_US` where this
process may run on :data:`ADAPTIVE_MIN_CORES` cores or more, else a fixed spin of
``spin_us`` (:func:`default_spin_max_us`; ``docs/connectors.md`` has the figures).
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["ADAPTIVE_MAX_US", "ADAPTIVE_MIN_CORES", "AdaptiveSpin", "default_spin_max_us", "usable_cores"]

#: the top of the adaptive range when the config leaves ``spin_max_us`` out and cores are to spare
ADAPTIVE_MAX_US = 1000.0
#: the fewest cores (this process's affinity) at which an unset ``spin_max_us`` adapts
ADAPTIVE_MIN_CORES = 4


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; the online count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API on this platform
        return os.cpu_count() or 1


def default_spin_max_us(spin_us: float, cores: int | None = None) -> float:
    """``spin_max_us`` for a config that leaves it out: adaptive up to :data:`ADAPTIVE_MAX_US` (at least
    ``spin_us``) on :data:`ADAPTIVE_MIN_CORES` cores or more, else ``spin_us`` (a fixed spin)."""
    if (usable_cores() if cores is None else cores) >= ADAPTIVE_MIN_CORES:
        return max(spin_us, ADAPTIVE_MAX_US)
    return spin_us


class AdaptiveSpin:
    """Spin budget between ``base_us`` and ``max_us``; ``address`` is what the native waits take."""

    __slots__ = ("_cells", "address")

    def __init__(self, base_us: float, max_us: float) -> None:
        base = int(base_us * 1000)
        self._cells = (ctypes.c_int64 * 3)(base, max(base, int(max_us * 1000)), base)
        self.address = ctypes.addressof(self._cells)

    @property
    def base_us(self) -> float:
        """The least the spin runs, in µs (``spin_us``)."""
        return self._cells[0] / 1000

    @property
    def max_us(self) -> float:
        """The most the spin adapts to, in µs (``spin_max_us``, at least ``base_us``)."""
        return self._cells[1] / 1000

    @property
    def current_us(self) -> float:
        """The budget the next wait spins for, in µs."""
        return self._cells[2] / 1000
