"""The native half of ShmAFDConnector (afd_connectors.shm._shmring): counters, doorbell, slot writes, copies."""

import multiprocessing as mp
import time

import pytest
import torch

from afd_connectors.shm import _shmring as ring
from afd_connectors.shm.spin import AdaptiveSpin

LINE = 64


@pytest.fixture
def seg():
    """A zeroed, 64-byte aligned scratch area (counters and two slots)."""
    buf = torch.zeros(16 * 1024 + LINE, dtype=torch.uint8)
    base = -(-buf.data_ptr() // LINE) * LINE
    return buf, base


def u64(buf, base, at):
    off = base - buf.data_ptr() + at
    return int(buf[off : off + 8].view(torch.int64)[0])


def test_load_publish_wait(seg):
    buf, base = seg
    counter, asleep = base, base + LINE
    assert ring.load(counter) == 0
    spin = AdaptiveSpin(1, 1)
    assert ring.wait_ge(counter, 1, asleep, spin.address, 1_000_000) is False  # a slice ends without the value
    ring.publish(counter, 7, asleep)
    assert ring.load(counter) == 7 and u64(buf, base, 0) == 7
    assert ring.wait_ge(counter, 7, asleep, 0, 0) is True
    assert u64(buf, base, LINE) == 0  # the sleep flag is cleared after a blocking slice


def test_write_slot_refuses_a_slot_still_being_read(seg):
    buf, base = seg
    published, released, asleep, slot = base, base + LINE, base + 2 * LINE, base + 4 * LINE
    src = torch.arange(16, dtype=torch.float32)
    # slot for seq 3 is free once seq 1 was released (2 slots): nothing is written before that
    assert ring.write_slot(released, 1, slot, 3, src.data_ptr(), src.nbytes, 4, 1, 16, 1, 0, published, asleep) is False
    assert ring.load(published) == 0
    ring.publish(released, 1, asleep)
    assert ring.write_slot(released, 1, slot, 3, src.data_ptr(), src.nbytes, 4, 1, 16, 1, 5, published, asleep) is True
    assert ring.load(published) == 3
    assert ring.recv_slot(published, 3, asleep, 0, 0, slot) == (3, 4, 1, 16, 1, 5)
    off = slot - buf.data_ptr() + LINE
    assert torch.equal(buf[off : off + src.nbytes].view(torch.float32), src)
    assert ring.recv_slot(published, 4, asleep, 0, 1_000_000, slot) is None  # not published yet


def test_copy(seg):
    buf, base = seg
    src = torch.randn(300)
    ring.copy(base, src.data_ptr(), src.nbytes)
    off = base - buf.data_ptr()
    assert torch.equal(buf[off : off + src.nbytes].view(torch.float32), src)
    ring.copy(base, src.data_ptr(), 0)  # empty copy: nothing happens


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda b: ring.load(b + 3), "aligned"),
        (lambda b: ring.wait_ge(0, 1, b, 0, 0), "aligned"),
        (lambda b: ring.wait_ge(b, 1, b + 64, 1000, 0), "spin=1000 is neither 0 nor"),  # a spin in ns, not its state
        (lambda b: ring.copy(b, b + 64, -1), "negative"),
        (lambda b: ring.copy(0, b, 8), "null"),
        (lambda b: ring.write_slot(b, 0, b + 64, 1, b + 128, 8, -1, 0, 1, 1, 0, b + 192, b + 256), "out of range"),
        (lambda b: ring.write_slot(b, 0, b + 64, 1, b + 128, 8, 0, 0, 1, 41, 0, b + 192, b + 256), "out of range"),
    ],
)
def test_bad_arguments_raise(seg, call, match):
    _buf, base = seg
    with pytest.raises(ValueError, match=match):
        call(base)


def test_wrong_argument_count():
    with pytest.raises(TypeError, match="takes 5 arguments"):
        ring.wait_ge(8, 1)


def _publisher(name: str, delay: float) -> None:
    from multiprocessing import shared_memory

    from afd_connectors.shm import _shmring

    shm = shared_memory.SharedMemory(name)
    t = torch.frombuffer(shm.buf, dtype=torch.uint8)
    time.sleep(delay)
    _shmring.publish(t.data_ptr(), 1, t.data_ptr() + LINE)
    del t
    shm.close()


@pytest.mark.multiprocess
def test_futex_wakes_a_blocked_waiter_in_another_process():
    """The waiter blocks (no spin) in one 20 s slice; the publisher's wake ends it long before."""
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=4096)
    try:
        t = torch.frombuffer(shm.buf, dtype=torch.uint8)
        t.zero_()
        proc = mp.get_context("spawn").Process(target=_publisher, args=(shm.name, 0.3))
        proc.start()
        try:
            t0 = time.monotonic()
            woke = ring.wait_ge(t.data_ptr(), 1, t.data_ptr() + LINE, 0, 20_000_000_000)
            waited = time.monotonic() - t0
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        assert woke is True
        assert waited < 15, f"the waiter slept {waited:.1f}s: the wake-up was lost"
        assert proc.exitcode == 0
        del t
    finally:
        shm.close()
        shm.unlink()
