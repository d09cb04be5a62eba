"""The FFN replicas' beacons and an attention rank's probe of them (``afd_ffn_replicas_live``): in one process,
and against a standby ``afd ffn serve --replica 1`` frozen and resumed. The attention rank's gauge during a
failover run is tests/test_failover.py's."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from afd_sdk.config import parse_config
from afd_sdk.control.endpoint import heartbeat_interval_s
from afd_sdk.errors import AFDConfigError, ConnectorError
from afd_sdk.runtime.failover import replica_world
from afd_sdk.runtime.replica_beacon import MISSED_LIMIT, ReplicaBeacon, ReplicaProbe, beacon_address, beacon_port
from afd_sdk.runtime.world import free_port_block

PERIOD_S = 0.05


class Counts:
    """What a probe reported, in order, with a bounded wait for a value."""

    def __init__(self) -> None:
        self.seen: list[int | None] = []
        self._cond = threading.Condition()

    def __call__(self, live: int | None) -> None:
        with self._cond:
            self.seen.append(live)
            self._cond.notify_all()

    def wait_for(self, live: int, within_s: float = 5.0) -> float:
        """Seconds until the probe reported ``live`` (the latest report), failing after ``within_s``."""
        start = time.monotonic()
        with self._cond:
            ok = self._cond.wait_for(lambda: self.seen and self.seen[-1] == live, within_s)
        assert ok, f"the probe never reported {live} within {within_s}s: {self.seen}"
        return time.monotonic() - start


def test_the_probe_counts_answering_replicas_and_follows_one_leaving_and_coming_back():
    port = free_port_block(3)
    addresses = [f"tcp://127.0.0.1:{port + i}" for i in range(3)]  # the third: nothing listens
    beacons = [ReplicaBeacon({port: addresses[0]}), ReplicaBeacon({port: addresses[1]})]
    for b in beacons:
        b.start()
    counts = Counts()
    probe = ReplicaProbe(addresses, PERIOD_S, counts)
    try:
        counts.wait_for(2)
        assert probe.live == 2
        beacons.pop().close()
        took = counts.wait_for(1)
        # gone once its last answer is MISSED_LIMIT periods old; a loaded host may add a few periods
        assert took < MISSED_LIMIT * PERIOD_S + 2.0, took
        beacons.append(ReplicaBeacon({port: addresses[1]}))  # a replica started again at the same port
        beacons[-1].start()
        counts.wait_for(2)
        # from the first count of both on (a loaded host may count one beacon first)
        assert counts.seen[counts.seen.index(2) :] == [2, 1, 2], counts.seen
    finally:
        probe.close()
        for b in beacons:
            b.close()


def test_one_beacon_answers_for_each_world_of_its_process_from_start_until_the_world_retires():
    """Bound first (the weights still load): no answer; started: every world answers; a world that ended is
    retired: its probe counts it out while the other world's still answers."""
    port = free_port_block(2)
    addresses = [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"]
    beacon = ReplicaBeacon({port: addresses[0], port + 1: addresses[1]})  # world port -> its beacon
    counts = [Counts(), Counts()]
    probes = [ReplicaProbe([a], PERIOD_S, c) for a, c in zip(addresses, counts, strict=True)]
    try:
        for c in counts:
            c.wait_for(0)  # bound, not started: the first count finds nothing answering
        beacon.start()
        for c in counts:
            c.wait_for(1)
        beacon.retire(port)
        counts[0].wait_for(0)
        time.sleep(MISSED_LIMIT * PERIOD_S * 2)
        assert counts[1].seen == [0, 1], counts[1].seen  # the other world answered throughout
    finally:
        for p in probes:
            p.close()
        beacon.close()


def test_a_beacon_port_in_use_is_refused_naming_it():
    port = free_port_block(1)
    address = f"tcp://127.0.0.1:{port}"
    first = ReplicaBeacon({port: address})  # binding is enough: before start(), as afd ffn serve binds it
    try:
        with pytest.raises(ConnectorError, match=f"cannot bind the FFN replica's beacon at {address}"):
            ReplicaBeacon({port: address})
    finally:
        first.close()


def test_beacon_ports_follow_each_replica_world_and_stay_inside_the_stride():
    cfg = parse_config({"role": "attention", "port": 30000, "ffn_replicas": 3, "num_ffn_ranks": 2, "num_stages": 2})
    # replica K's world at 30000 + 32 K uses F x (1 + S) = 6 ports; the beacons of FFN ranks 0 and 1 follow
    assert [beacon_port(replica_world(cfg, k), f) for k in range(3) for f in range(2)] == [
        30006, 30007, 30038, 30039, 30070, 30071,
    ]  # fmt: skip
    hosts = parse_config({"role": "attention", "port": 30000, "ffn_replicas": 2, "replica_hosts": "10.0.0.3,10.0.0.4"})
    assert [beacon_address(replica_world(hosts, k), 0) for k in range(2)] == [
        "tcp://10.0.0.3:30002",
        "tcp://10.0.0.4:30034",
    ]
    # the smallest stride holds a replica's world and its beacons: F x (2 + S)
    parse_config({"role": "ffn", "ffn_replicas": 2, "num_ffn_ranks": 2, "num_stages": 2, "replica_port_stride": 8})
    with pytest.raises(AFDConfigError, match="at least 8 with ffn_replicas > 1") as err:
        parse_config({"role": "ffn", "ffn_replicas": 2, "num_ffn_ranks": 2, "num_stages": 2, "replica_port_stride": 7})
    assert err.value.key == "afd.replica_port_stride"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    pytest.importorskip("transformers", reason="the runtime needs the [hf] extra")
    from afd_sdk.integrations.transformers import save_tiny_checkpoint

    return str(save_tiny_checkpoint("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("qwen")))


@pytest.mark.multiprocess
def test_a_standby_replica_answers_once_it_listens_and_not_while_frozen(qwen_dir, tmp_path):
    """``afd ffn serve --replica 1`` waiting for its attention peers: an attention rank's probe counts it once the
    weights are loaded, not while it is stopped (SIGSTOP: its process, beacon thread included, answers nothing),
    and again once it resumes; replica 0, never started, never counts."""
    cfg = {"connector": "zmq", "host": "127.0.0.1", "port": free_port_block(64), "timeout_s": 3,
           "connect_timeout_s": 120, "ffn_replicas": 2}  # fmt: skip
    log = tmp_path / "ffn1.err"
    argv = [sys.executable, "-m", "afd_sdk.cli", "ffn", "serve", "--model", qwen_dir, "--config", json.dumps(cfg)]
    with open(log, "w") as err:
        proc = subprocess.Popen([*argv, "--replica", "1"], stdout=subprocess.DEVNULL, stderr=err)
    attention = parse_config({**cfg, "role": "attention"})
    counts = Counts()
    probe = None
    try:
        deadline = time.monotonic() + 120
        while "waiting for attention peers" not in log.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        beacons = [beacon_address(replica_world(attention, k), 0) for k in range(2)]
        probe = ReplicaProbe(beacons, heartbeat_interval_s(attention.timeout_s), counts)
        counts.wait_for(1)
        proc.send_signal(signal.SIGSTOP)
        took = counts.wait_for(0, within_s=10)
        period = heartbeat_interval_s(attention.timeout_s)
        assert took >= (MISSED_LIMIT - 1) * period, (took, counts.seen)  # its last answer ages out, not sooner
        proc.send_signal(signal.SIGCONT)
        counts.wait_for(1, within_s=10)
        assert counts.seen == [1, 0, 1]
    finally:
        if probe is not None:
            probe.close()
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(30)
