"""The adaptive spin of ShmAFDConnector's waits: the rule, real waits teaching it, and its configuration."""

import ctypes
import threading
import time

import pytest

from afd_sdk.config import parse_config
from afd_sdk.errors import AFDConfigError
from afd_sdk.plugins import get_plugin_manager

_shmring = pytest.importorskip("afd_connectors.shm._shmring", reason="the native ring is built by pip install")
from afd_connectors.shm.connector import ShmExtraConfig  # noqa: E402
from afd_connectors.shm.spin import AdaptiveSpin, default_spin_max_us, usable_cores  # noqa: E402


def _learn(spin: AdaptiveSpin, waited_us: float, *, slept: bool, reached: bool = True) -> float:
    _shmring.spin_learn(spin.address, int(waited_us * 1000), slept, reached)
    return spin.current_us


def test_a_wait_that_slept_and_ended_within_max_raises_the_spin_to_cover_it():
    spin = AdaptiveSpin(100, 1000)
    assert (spin.base_us, spin.max_us, spin.current_us) == (100, 1000, 100)
    assert _learn(spin, 300, slept=True) == 450  # the wait (wake-up included) and half again
    assert _learn(spin, 200, slept=True) == 300  # follows the last wait down as well as up
    assert _learn(spin, 900, slept=True) == 1000  # never above max
    assert _learn(spin, 20, slept=True) == 100  # never below base


@pytest.mark.parametrize("reached", [True, False])
def test_a_wait_past_max_or_unanswered_puts_the_spin_back_to_base(reached):
    spin = AdaptiveSpin(100, 1000)
    _learn(spin, 600, slept=True)
    waited = 5000 if reached else 300  # a computing peer, or a slice that ended without an answer
    assert _learn(spin, waited, slept=True, reached=reached) == 100


def test_waits_well_inside_the_spin_let_it_decay_toward_base():
    spin = AdaptiveSpin(100, 1000)
    _learn(spin, 900, slept=True)
    assert _learn(spin, 10, slept=False) == 887.5  # an eighth of the way to max(base, 2 x wait)
    assert _learn(spin, 480, slept=False) == 887.5  # a wait of more than half the spin keeps it
    for _ in range(200):
        _learn(spin, 10, slept=False)
    assert spin.current_us == pytest.approx(100, abs=0.01)
    assert _learn(spin, 10, slept=False) >= 100


def test_spin_max_equal_to_spin_is_a_fixed_spin():
    spin = AdaptiveSpin(100, 100)
    assert _learn(spin, 90, slept=True) == 100
    assert AdaptiveSpin(100, 50).max_us == 100  # max is at least base


def _cells() -> tuple[ctypes.Array, int, int]:
    cells = (ctypes.c_uint64 * 16)()  # counter and sleep flag on their own lines
    base = ctypes.addressof(cells)
    return cells, base, base + 64


def test_real_waits_teach_the_spin():
    """A wait that sleeps through a late answer raises the spin; a slice nobody answers puts it back."""
    _alive, counter, flag = _cells()  # _alive owns the memory the addresses point into
    spin = AdaptiveSpin(20, 100_000)
    answered = threading.Event()

    def answer_late() -> None:
        deadline = time.monotonic() + 10
        while _shmring.load(flag) == 0 and time.monotonic() < deadline:  # the waiter is asleep
            time.sleep(0.0002)
        time.sleep(0.003)
        _shmring.publish(counter, 1, flag)
        answered.set()

    t = threading.Thread(target=answer_late)
    t.start()
    try:
        assert _shmring.wait_ge(counter, 1, flag, spin.address, 10_000_000_000)
    finally:
        t.join(10)
    assert answered.is_set()
    assert 4500 <= spin.current_us <= 100_000  # slept >= 3 ms after its spin: 1.5 x that at least
    assert not _shmring.wait_ge(counter, 2, flag, spin.address, 1_000_000)  # nobody answers within 1 ms
    assert spin.current_us == 20
    assert not _shmring.wait_ge(counter, 2, flag, 0, 1_000_000)  # 0: no spin, and no budget to teach


def test_a_misaligned_spin_address_is_refused():
    _alive, counter, flag = _cells()  # _alive owns the memory the addresses point into
    with pytest.raises(ValueError, match="spin=.* 8-byte aligned"):
        _shmring.wait_ge(counter, 0, flag, counter + 3, 0)
    with pytest.raises(ValueError, match="spin=0"):
        _shmring.spin_learn(0, 1, True, True)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"spin_us": 200, "spin_max_us": 100}, "afd.connector_extra_config.spin_max_us"),
        ({"spin_us": -1}, "spin_us"),
        ({"spin_max_us": "fast"}, "spin_max_us"),
    ],
)
def test_spin_configuration_errors_name_the_key(extra, key):
    cfg = parse_config({"role": "ffn", "connector": "shm", "host": "127.0.0.1", "connector_extra_config": extra})
    with pytest.raises(AFDConfigError) as info:
        get_plugin_manager().resolve_config(cfg)
    assert key in str(info.value)


@pytest.mark.parametrize(
    ("cores", "spin_us", "top"), [(1, 100, 100), (2, 100, 100), (3, 0, 0), (4, 100, 1000), (64, 2000, 2000)]
)
def test_an_unset_spin_max_adapts_only_with_cores_to_spare(cores, spin_us, top):
    assert default_spin_max_us(spin_us, cores) == top


def test_the_config_resolves_an_unset_spin_max_for_this_process(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(2)))
    assert usable_cores() == 2
    assert ShmExtraConfig().spin_range() == (100.0, 100.0)  # shared cores: a fixed spin
    assert ShmExtraConfig(spin_us=0).spin_range() == (0.0, 0.0)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(8)))
    assert ShmExtraConfig().spin_range() == (100.0, 1000.0)
    assert ShmExtraConfig(spin_us=5, spin_max_us=50).spin_range() == (5, 50)  # set: taken as given
    assert ShmExtraConfig(spin_us=5000).spin_range() == (5000, 5000)  # the range is never below spin_us


def test_a_large_spin_us_alone_is_accepted():
    cfg = parse_config(
        {"role": "ffn", "connector": "shm", "host": "127.0.0.1", "connector_extra_config": {"spin_us": 5000}}
    )
    get_plugin_manager().resolve_config(cfg)  # an unset spin_max_us is never below spin_us
