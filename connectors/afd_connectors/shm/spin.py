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
"""

from __future__ import annotations

import ctypes

__all__ = ["AdaptiveSpin"]


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
