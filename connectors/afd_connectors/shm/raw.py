"""The raw transport under ``ShmAFDConnector``, for ``afd bench connector``'s ``shm`` baseline.

It drives the native ring (``afd_connectors.shm._shmring``) directly: one copy
into the slot per direction, the FFN echoes straight from its input slot, the
spin-then-futex doorbell, no connector API — the same-host floor of that
design. It takes the run's ``connector_extra_config`` (``extra=``), so its
rings have the connector's ``slots`` and adaptive spin (``spin_us``, ``spin_max_us``): with the default two
slots per ring a 512 KiB round trip touches twice the memory one slot does,
which reads ~3 µs slower on a 1 MiB L2 (measured in turns, 4 rounds:
13.3–15.2 µs with one slot, 17.0–18.5 µs with two). It lives with the
connector because it uses the connector's native module;
``ShmAFDConnector.raw_baselines`` exposes it to the benchmark.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import torch

__all__ = ["RawShm"]


class RawShm:
    """ShmAFDConnector's ring without the connector: one ring of ``slots`` slots each way in one segment.

    Layout: ``[a2f counters (4 lines)][f2a counters (4 lines)][a2f slots][f2a slots]``, counters as in
    the connector (published, released, reader asleep, writer asleep); a slot is a 64-byte meta line
    plus the payload. Message ``seq`` uses slot ``(seq - 1) % slots``, as in the connector.
    """

    _SLICE_NS = 20_000_000

    def __init__(
        self,
        role: str,
        *,
        host: str,
        port: int,
        max_bytes: int,
        timeout_s: float,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        from afd_connectors.shm import _shmring
        from afd_connectors.shm.connector import ShmExtraConfig
        from afd_connectors.shm.spin import AdaptiveSpin

        config = msgspec.convert(dict(extra or {}), ShmExtraConfig)
        self.ring = _shmring
        self.timeout_s = timeout_s
        self.spin = AdaptiveSpin(*config.spin_range())
        self.slots = config.slots
        self.path = f"/dev/shm/afd-bench-{port}"
        self.slot_size = slot = 64 + -(-max_bytes // 64) * 64
        size = 512 + 2 * self.slots * slot
        if role == "ffn":
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
        else:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fd = os.open(self.path, os.O_RDWR)
                    break
                except FileNotFoundError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{self.path} did not appear within {timeout_s:g}s") from None
                    time.sleep(0.001)
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if role == "attention":
            os.unlink(self.path)  # both mapped it: nothing stays in /dev/shm
        self.seg: torch.Tensor | None = torch.frombuffer(self.mm, dtype=torch.uint8)
        base = self.seg.data_ptr()
        # (published, released, reader asleep, writer asleep, first slot) per direction
        self.a2f = (base, base + 64, base + 128, base + 192, base + 512)
        self.f2a = (base + 256, base + 320, base + 384, base + 448, base + 512 + self.slots * slot)
        self.seq = 0

    def _wait(self, counter: int, want: int, asleep: int) -> None:
        if self.ring.wait_ge(counter, want, asleep, self.spin.address, self._SLICE_NS):
            return
        deadline = time.monotonic() + self.timeout_s
        while not self.ring.wait_ge(counter, want, asleep, 0, self._SLICE_NS):
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw shm peer silent for {self.timeout_s:g}s")

    def _slot(self, ring: tuple[int, int, int, int, int], seq: int) -> int:
        return ring[4] + ((seq - 1) % self.slots) * self.slot_size

    def _send(self, ring: tuple[int, int, int, int, int], seq: int, src: int, nbytes: int) -> None:
        published, released, reader_asleep, writer_asleep, _ = ring
        slot, free_at = self._slot(ring, seq), seq - self.slots
        while not self.ring.write_slot(
            released, free_at, slot, seq, src, nbytes, 0, 0, 0, 1, 0, published, reader_asleep
        ):
            self._wait(released, free_at, writer_asleep)

    def attention_round_trip(self, payload: torch.Tensor) -> Callable[[], None]:
        src, nbytes = payload.data_ptr(), payload.nbytes
        a2f, f2a = self.a2f, self.f2a
        publish = self.ring.publish

        def rt(_keep: torch.Tensor = payload) -> None:  # the payload lives as long as the call that copies from it
            self.seq += 1
            seq = self.seq
            self._send(a2f, seq, src, nbytes)
            self._wait(f2a[0], seq, f2a[2])
            publish(f2a[1], seq, f2a[3])  # read in place: free the slot

        return rt

    def ffn_echo(self, count: int, nbytes: int) -> None:
        a2f, f2a = self.a2f, self.f2a
        for _ in range(count):
            self.seq += 1
            seq = self.seq
            self._wait(a2f[0], seq, a2f[2])
            self._send(f2a, seq, self._slot(a2f, seq) + 64, nbytes)  # echo straight from the input slot
            self.ring.publish(a2f[1], seq, a2f[3])

    def close(self) -> None:
        self.seg = None
        self.mm.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass  # the attention side unlinked it once both had mapped it
