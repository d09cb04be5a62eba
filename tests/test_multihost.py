"""Two hosts on one machine: the FFN server and the attention runner in separate network namespaces.

Two namespaces joined by a veth pair, each with its own address, stand in for two hosts. For zmq, p2p
(Gloo) and the CAM portable backend (its cases ``-m slow``: CAM crosses hosts with p2p's process-group code):

* the FFN side starts 10x ``timeout_s`` before the attention side, which still meets it (the rendezvous
  waits ``connect_timeout_s``), and the cross-host split equals the native reference;
* the link goes down mid-generation: both sides exit 3 (peer lost) within ``timeout_s`` plus slack, with one
  ``error:`` line and no traceback;
* the FFN process is frozen (SIGSTOP): the attention side fails within the same bound;
* while the two sides exchange, every socket either process listens on (control plane, data plane,
  ``TCPStore``, Gloo devices) is bound to its host's own address, none to every interface; the same for
  the same-host shm connector.

Needs root and ``ip netns`` (iproute2); skips saying which is missing. Every namespace, link and process it
creates is removed, also when a test fails.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import threading
import time

import pytest
from listening import is_wildcard, listening
from netns import Hosts, NetnsUnavailable, two_hosts

pytest.importorskip("transformers", reason="the runtime needs the [hf] extra")

from afd_sdk.integrations.transformers import save_tiny_checkpoint

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 2.0
#: detection (heartbeats: 3 intervals of timeout_s / 6) and the process's way out (torch teardown); measured
#: 0.9-2.0 s beyond timeout_s on a 2-core machine
SLACK_S = 8.0


@pytest.fixture(scope="module")
def hosts():
    try:
        with two_hosts("afd") as made:
            yield made
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {a: save_tiny_checkpoint(a, root / a) for a in ("Qwen3MoeForCausalLM",)}


#: connector -> (extra config, whose address is afd.host): CAM's world is Attention-first (its store master is
#: attention rank 0), the others are FFN-first
CASES = {
    "zmq": ({}, "ffn"),
    "p2p": ({}, "ffn"),
    "CAMAsyncAFDConnector": ({"compute_gate_on_attention": True}, "attention"),
}
#: CAM's portable backend crosses hosts with p2p's Gloo process-group code (interface choice, store socket, loss
#: detection), which the p2p cases run by default; its cases are `-m slow` (CI time on 2 cores)
DEFAULT_CASES = [pytest.param(c, marks=pytest.mark.slow) if c == "CAMAsyncAFDConnector" else c for c in CASES]
#: the early-start cases with -m slow (CI time): a rendezvous that waits past the exchange deadline is
#: test_zmq_control.py's either-side-first test, and the split across hosts equal to native runs in CI below
#: (the FFN pool across hosts, the partitioned replica)
EARLY_START_CASES = [pytest.param(c, marks=pytest.mark.slow) for c in CASES]


def _config(hosts: Hosts, connector: str, port: int) -> str:
    extra, owner = CASES[connector]
    host = hosts.ffn_ip if owner == "ffn" else hosts.attn_ip
    # each side's /metrics endpoint too (its own namespace, so one port number serves both)
    return json.dumps(
        {
            "connector": connector,
            "host": host,
            "port": port,
            "timeout_s": TIMEOUT_S,
            "metrics_port": port + METRICS_OFFSET,
            **extra,
        }
    )


#: the metrics endpoint's port, above the connector's ports in the block of 16 from ``_port()``
METRICS_OFFSET = 15


class Lines:
    """Collects a pipe's lines in a thread; ``wait_for`` blocks until one contains a text."""

    def __init__(self, pipe) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return True
            time.sleep(0.05)
        return False

    @property
    def text(self) -> str:
        self._thread.join(5)
        return "".join(self.lines)


def _one_clear_error(stderr: str, who: str) -> None:
    assert "Traceback" not in stderr, f"{who} printed a traceback:\n{stderr[-3000:]}"
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, f"{who} should print exactly one error line:\n{stderr[-3000:]}"


def _heal_and_stop(hosts: Hosts, *procs: subprocess.Popen[str]) -> None:
    """The link back up, then every process that is still running killed and reaped (a test's ``finally``)."""
    hosts.link(up=True)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)


def _port() -> int:
    from afd_sdk.runtime.world import free_port_block

    return free_port_block(16)


@pytest.fixture
def world(hosts, model_dirs):
    """Starts the two sides in their namespaces; kills whatever is left at the end."""
    procs: list[subprocess.Popen[str]] = []
    model = str(model_dirs["Qwen3MoeForCausalLM"])

    def start(connector: str, port: int, *, tokens: int, reference: bool = False):
        cfg = _config(hosts, connector, port)
        ffn = hosts.run(hosts.ffn_ns, "ffn", "serve", "--model", model, "--config", cfg, "--json")
        procs.append(ffn)
        ffn_err = Lines(ffn.stderr)

        def attention() -> subprocess.Popen[str]:
            args = [
                "attention",
                "generate",
                "--model",
                model,
                "--config",
                cfg,
                "--prompt-ids",
                "5,6,7,8",
                "--max-new-tokens",
                str(tokens),
                "--json",
            ]
            gen = hosts.run(hosts.attn_ns, *args, *(["--reference"] if reference else []))
            procs.append(gen)
            return gen

        return ffn, ffn_err, attention

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)


@pytest.mark.parametrize("connector", EARLY_START_CASES)
def test_cross_host_split_equals_native_with_the_ffn_started_10x_timeout_early(world, connector):
    ffn, ffn_err, attention = world(connector, _port(), tokens=4, reference=True)
    time.sleep(10 * TIMEOUT_S)  # the FFN side waits longer than its exchange deadline for its peers
    assert ffn.poll() is None, f"the FFN side gave up before its peers came:\n{ffn_err.text[-3000:]}"
    gen = attention()
    out, err = gen.communicate(timeout=240)
    assert gen.returncode == 0, err[-3000:]
    result = json.loads(out)
    assert result["tokens_equal"] and result["max_abs_diff"] <= 1e-5, result
    ffn.wait(60)
    assert ffn.returncode == 0, ffn_err.text[-3000:]


def _assert_bound(sockets: set[tuple[str, int]], addresses: set[str], connector: str) -> None:
    wildcard = sorted(s for s in sockets if is_wildcard(s[0]))
    assert not wildcard, f"{connector}: sockets listening on every interface: {wildcard}"
    assert sockets, f"{connector}: no listening socket seen while the two sides exchanged"
    assert {addr for addr, _ in sockets} <= addresses, (connector, sockets)


@pytest.mark.parametrize("connector", DEFAULT_CASES)
def test_link_down_mid_generation_ends_both_sides_with_one_error(world, hosts, connector):
    port = _port()
    ffn, ffn_err, attention = world(connector, port, tokens=4000)
    gen = attention()
    gen_err = Lines(gen.stderr)
    try:
        assert ffn_err.wait_for("connected", 120), ffn_err.text[-3000:]
        time.sleep(2)  # exchanging
        assert gen.poll() is None and ffn.poll() is None, gen_err.text[-3000:] + ffn_err.text[-3000:]
        sockets = listening({ffn.pid, gen.pid})
        _assert_bound(sockets, {hosts.ffn_ip, hosts.attn_ip}, connector)
        if connector == "p2p":  # the control plane, the TCPStore and a Gloo device per process
            assert len(sockets) >= 4, sockets
        # each side's metrics endpoint, on its own address
        assert {(hosts.ffn_ip, port + METRICS_OFFSET), (hosts.attn_ip, port + METRICS_OFFSET)} <= sockets, sockets
        hosts.link(up=False)
        cut = time.monotonic()
        for p in (gen, ffn):
            p.wait(TIMEOUT_S + SLACK_S)
        elapsed = time.monotonic() - cut
    finally:
        hosts.link(up=True)
    print(f"{connector}: link down -> both sides exited after {elapsed:.1f}s (timeout_s={TIMEOUT_S:g})")
    assert gen.returncode == ffn.returncode == 3, (gen.returncode, ffn.returncode)  # 3: a peer was lost
    assert elapsed <= TIMEOUT_S + SLACK_S, elapsed
    _one_clear_error(gen_err.text, "attention")
    _one_clear_error(ffn_err.text, "ffn")


@pytest.mark.parametrize("connector", DEFAULT_CASES)
def test_frozen_ffn_fails_the_attention_side_in_time(world, connector):
    ffn, ffn_err, attention = world(connector, _port(), tokens=4000)
    gen = attention()
    gen_err = Lines(gen.stderr)
    assert ffn_err.wait_for("connected", 120), ffn_err.text[-3000:]
    time.sleep(2)
    assert gen.poll() is None, gen_err.text[-3000:]
    os.kill(ffn.pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        gen.wait(TIMEOUT_S + SLACK_S)
        elapsed = time.monotonic() - frozen
    finally:
        ffn.kill()  # SIGKILL ends a stopped process too
    print(f"{connector}: FFN frozen -> attention exited after {elapsed:.1f}s (timeout_s={TIMEOUT_S:g})")
    assert gen.returncode == 3, gen.returncode  # a peer was lost
    assert elapsed <= TIMEOUT_S + SLACK_S, elapsed
    _one_clear_error(gen_err.text, "attention")


def test_shm_listens_only_on_the_configured_address(hosts, model_dirs):
    """shm is same-host only (afd.host must be loopback): both sides in one namespace."""
    model = str(model_dirs["Qwen3MoeForCausalLM"])
    cfg = json.dumps({"connector": "shm", "host": "127.0.0.1", "port": _port(), "timeout_s": TIMEOUT_S})
    ffn = hosts.run(hosts.ffn_ns, "ffn", "serve", "--model", model, "--config", cfg)
    gen = hosts.run(
        hosts.ffn_ns,
        "attention",
        "generate",
        "--model",
        model,
        "--config",
        cfg,
        "--prompt-ids",
        "5,6",
        "--max-new-tokens",
        "4000",
    )
    ffn_err = Lines(ffn.stderr)
    try:
        assert ffn_err.wait_for("connected", 120), ffn_err.text[-3000:]
        time.sleep(1)
        assert gen.poll() is None, gen.stderr.read()[-3000:]
        _assert_bound(listening({ffn.pid, gen.pid}), {"127.0.0.1"}, "shm")
    finally:
        for p in (gen, ffn):
            p.kill()
            p.wait(30)


#: an FFN pool across hosts (afd.ffn_hosts): zmq binds each FFN rank's sockets on its own host; p2p's groups
#: meet at FFN rank 0's store and each process's Gloo device takes the interface on its route there
POOL_CASES = ["zmq", pytest.param("p2p", marks=pytest.mark.slow)]


@pytest.mark.parametrize("connector", POOL_CASES)
def test_ffn_pool_across_hosts_equals_native(hosts, model_dirs, connector):
    """2A2F: FFN rank 0 on one host, FFN rank 1 beside the two attention ranks on the other."""
    model = str(model_dirs["Qwen3MoeForCausalLM"])
    port = _port()
    cfg = json.dumps(
        {
            "connector": connector,
            "ffn_hosts": [hosts.ffn_ip, hosts.attn_ip],
            "port": port,
            "num_attention_ranks": 2,
            "num_ffn_ranks": 2,
            "timeout_s": TIMEOUT_S,
        }
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank, ns in ((0, hosts.ffn_ns), (1, hosts.attn_ns)):
            procs.append(hosts.run(ns, "ffn", "serve", "--model", model, "--config", cfg, "--rank", str(rank)))
        gens = [
            hosts.run(
                hosts.attn_ns,
                *("attention", "generate", "--model", model, "--config", cfg, "--rank", str(rank)),
                *("--prompt-ids", f"{5 + rank},6,7", "--max-new-tokens", "48", "--reference", "--json"),
            )
            for rank in (0, 1)
        ]
        procs += gens
        errs = [Lines(p.stderr) for p in procs[:2]]
        assert all(e.wait_for("connected", 180) for e in errs), [e.text[-2000:] for e in errs]
        sockets = listening({p.pid for p in procs})
        _assert_bound(sockets, {hosts.ffn_ip, hosts.attn_ip}, connector)
        # each FFN rank's control plane on its own host's address
        assert {(hosts.ffn_ip, port), (hosts.attn_ip, port + 1)} <= sockets, (sockets, [e.text[-1500:] for e in errs])
        for gen in gens:
            out, err = gen.communicate(timeout=240)
            assert gen.returncode == 0, err[-3000:]
            result = json.loads(out)
            assert result["tokens_equal"] and result["max_abs_diff"] <= 1e-5, result
        for ffn, err in zip(procs[:2], errs, strict=True):
            ffn.wait(60)
            assert ffn.returncode == 0, err.text[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)


@pytest.mark.parametrize("connector", ["zmq", "p2p"])
def test_a_partitioned_replica_on_another_host_is_replaced_and_nothing_is_lost(hosts, model_dirs, connector):
    """afd.replica_hosts: replica 0 across the link, replica 1 beside the attention rank; the link goes down.
    p2p: no reset crosses a downed link, so the exchange's Gloo wait ends at ``timeout_s`` (the heartbeats, between
    steps) and the attention rank's new process group is replica 1's."""
    model = str(model_dirs["Qwen3MoeForCausalLM"])
    cfg = json.dumps(
        {
            "connector": connector,
            "replica_hosts": [hosts.ffn_ip, hosts.attn_ip],
            "ffn_replicas": 2,
            "port": _port(),
            "timeout_s": TIMEOUT_S,
        }
    )
    serve = ("ffn", "serve", "--model", model, "--config", cfg, "--json")
    replicas = [hosts.run(hosts.ffn_ns, *serve, "--replica", "0"), hosts.run(hosts.attn_ns, *serve, "--replica", "1")]
    errs = [Lines(r.stderr) for r in replicas]
    gen = hosts.run(hosts.attn_ns, "attention", "generate", "--model", model, "--config", cfg,
                    "--prompt-ids", "5,6,7", "--max-new-tokens", "600", "--reference", "--json")  # fmt: skip
    gen_err, gen_out = Lines(gen.stderr), Lines(gen.stdout)  # one reader per pipe
    try:
        assert errs[0].wait_for("connected", 120), errs[0].text[-3000:]
        time.sleep(1)  # generating on replica 0, across the link
        assert gen.poll() is None, gen_err.text[-3000:]
        hosts.link(up=False)
        gen.wait(240)
        out = gen_out.text
    finally:
        _heal_and_stop(hosts, *replicas, gen)
    log = gen_err.text
    assert gen.returncode == 0, log[-3000:]
    result = json.loads(out)
    assert result["tokens_equal"] and result["max_abs_diff"] == 0.0, result
    assert "replica 0 of ffn rank 0 lost" in log and "now served by replica 1 (failover 1," in log, log[-3000:]
    print([line for line in log.splitlines() if "replica" in line])


def test_a_partitioned_cam_ffn_rank_on_another_host_is_routed_around_and_nothing_is_lost(hosts, model_dirs):
    """Routed dispatch with every expert on both FFN ranks (``expert_replicas`` 2): FFN rank 1 across the link, FFN
    rank 0 beside the attention rank (whose address is the world's: CAM's store master); the link goes down
    mid-generation. FFN rank 1's heartbeats stop reaching the store and its Gloo connections hang without a reset:
    the attention rank gives it up within its liveness limit, routes its experts to FFN rank 0 (re-dispatching
    what was in flight) and finishes with the reference's tokens; FFN rank 0 exits 0 at the goodbye."""
    model = str(model_dirs["Qwen3MoeForCausalLM"])
    cfg = json.dumps(
        {
            "connector": "CAMAsyncAFDConnector",
            "compute_gate_on_attention": True,
            "host": hosts.attn_ip,
            "port": _port(),
            "timeout_s": TIMEOUT_S,
            "num_ffn_ranks": 2,
            "connector_extra_config": {"expert_replicas": 2},
        }
    )
    serve = ("ffn", "serve", "--model", model, "--config", cfg, "--rank")
    ranks = [hosts.run(hosts.attn_ns, *serve, "0"), hosts.run(hosts.ffn_ns, *serve, "1")]
    errs = [Lines(r.stderr) for r in ranks]
    gen = hosts.run(hosts.attn_ns, "attention", "generate", "--model", model, "--config", cfg,
                    "--prompt-ids", "5,6,7", "--max-new-tokens", "240", "--reference", "--json")  # fmt: skip
    gen_err, gen_out = Lines(gen.stderr), Lines(gen.stdout)
    try:
        assert errs[1].wait_for("connected", 120), errs[1].text[-3000:]
        time.sleep(1)  # dispatching to both FFN ranks, one across the link
        assert gen.poll() is None, gen_err.text[-3000:]
        hosts.link(up=False)
        gen.wait(240)
        out = gen_out.text
        assert ranks[0].wait(60) == 0, errs[0].text[-3000:]
    finally:
        _heal_and_stop(hosts, *ranks, gen)
    log = gen_err.text
    assert gen.returncode == 0, log[-3000:]
    result = json.loads(out)
    assert result["tokens_equal"] and len(result["tokens"][0]) == 240 and result["max_abs_diff"] <= 1e-5, result
    assert "ffn rank 1 lost" in log, log[-3000:]
    print(*(line for line in log.splitlines() if "re-dispatched" in line or "lost (" in line), sep="\n")


@pytest.mark.slow  # a minute and more of generation with six faults (CI time on 2 cores)
def test_chaos_kills_freezes_and_partitions_of_the_replica_in_use_lose_nothing(hosts, model_dirs):
    """Three replicas of FFN rank 0: replica 0 across the link, replicas 1 and 2 beside the attention rank. Six
    faults of the replica in use, each followed by a fresh standby in its place (the link back up first): a
    partition (the link goes down) whenever replica 0 is in use, else kill -9 or SIGSTOP at random. The order of
    replicas wraps, so replica 0 is partitioned twice. The generation exits 0 with the reference's tokens."""
    from afd_sdk.runtime.world import free_port_block

    rng = random.Random(20261206)
    model = str(model_dirs["Qwen3MoeForCausalLM"])
    cfg = json.dumps(
        {
            "connector": "zmq",
            "replica_hosts": [hosts.ffn_ip, hosts.attn_ip, hosts.attn_ip],
            "ffn_replicas": 3,
            "port": free_port_block(96),  # replica K's world at port + 32 K
            "timeout_s": TIMEOUT_S,
            "num_stages": 2,  # two requests, one per stage: slow enough steps for six faults and restarts
        }
    )
    where = [hosts.ffn_ns, hosts.attn_ns, hosts.attn_ns]
    serve = ("ffn", "serve", "--model", model, "--config", cfg, "--json")
    procs = [hosts.run(where[k], *serve, "--replica", str(k)) for k in range(3)]
    errs = [Lines(p.stderr) for p in procs]
    retired: list[subprocess.Popen[str]] = []
    gen = hosts.run(hosts.attn_ns, "attention", "generate", "--model", model, "--config", cfg,
                    "--prompt-ids", "5,6,7", "--prompt-ids", "6,6,7", "--max-new-tokens", "4000", "--reference",
                    "--json")  # fmt: skip
    gen_err, gen_out = Lines(gen.stderr), Lines(gen.stdout)
    faults: list[str] = []
    try:
        assert errs[0].wait_for("connected", 120), "".join(errs[0].lines + gen_err.lines)[-3000:]
        used = 0
        for n in range(1, 7):
            time.sleep(0.5)  # generating on `used`
            assert gen.poll() is None, "".join(gen_err.lines)[-3000:]
            fault = "partition" if used == 0 else rng.choice(["kill", "stop"])
            if fault == "partition":
                hosts.link(up=False)
            else:
                procs[used].send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            faults.append(fault)
            deadline = time.monotonic() + 60
            while not any(f"(failover {n}," in line for line in gen_err.lines):
                assert time.monotonic() < deadline and gen.poll() is None, "".join(gen_err.lines)[-3000:]
                time.sleep(0.02)
            hosts.link(up=True)
            # the faulted replica's place: a fresh standby at the same address and ports
            procs[used].kill()
            procs[used].wait(30)
            retired.append(procs[used])
            procs[used] = hosts.run(where[used], *serve, "--replica", str(used))
            errs[used] = Lines(procs[used].stderr)
            assert errs[used].wait_for("waiting for attention peers", 120), "".join(errs[used].lines)[-3000:]
            used = int(re.findall(r"now served by replica (\d+) \(failover", "".join(gen_err.lines))[-1])
        gen.wait(600)
        out = gen_out.text
    finally:
        _heal_and_stop(hosts, *procs, *retired, gen)
    log = gen_err.text
    assert gen.returncode == 0, log[-3000:]
    result = json.loads(out)
    assert result["tokens_equal"] and result["max_abs_diff"] == 0.0, result["max_abs_diff"]
    assert faults.count("partition") == 2, faults
    stalls = sorted(float(m) for m in re.findall(r"now served by replica \d+ \(failover \d+, (\d+) ms", log))
    assert len(stalls) == 6, log[-3000:]
    print(f"chaos {faults}: failover after the loss was seen: p50 {stalls[3]:.0f} ms, max {stalls[-1]:.0f} ms")
