"""Metrics and health: the recorder, the Prometheus families, the HTTP endpoint, and both CLI roles scraped live."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from afd_sdk.config import parse_config
from afd_sdk.errors import AFDConfigError, PeerLostError
from afd_sdk.metrics import EXCHANGE_BUCKETS_S, MetricsHub, collector, registry
from afd_sdk.runtime.ops_server import OpsServer, metrics_address
from afd_sdk.runtime.world import free_port_block


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def _value(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    found = [v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {found}"
    return found[0]


# --- recorder and families --------------------------------------------------------------------------


def test_families_carry_every_recorded_value():
    hub = MetricsHub()
    rec = hub.recorder(connector="ZmqAFDConnector", role="ffn", rank=1, port=29650, num_stages=2)
    rec.observe_step(7)
    rec.observe_exchange(0, 3e-5, 100, 200)
    rec.observe_exchange(1, 0.2, 10, 20)
    rec.observe_exchange(1, 99.0, 1, 2)  # beyond the last bound: only +Inf
    rec.observe_compute(1e-3, 7)
    rec.observe_expert_rows(4, [2, 0, 5])
    rec.observe_expert_rows(4, [1, 1, 0])
    rec.count_error(PeerLostError("gone"))
    rec.set_peer_state("connected")
    text = _exposition(hub)
    s = _samples(text)
    lab = {"connector": "ZmqAFDConnector", "role": "ffn", "rank": "1", "port": "29650"}
    assert _value(s, "afd_steps_total", **lab) == 1
    assert _value(s, "afd_step_tokens_sum", **lab) == 7
    assert _value(s, "afd_sent_bytes_total", **lab) == 111
    assert _value(s, "afd_received_bytes_total", **lab) == 222
    assert _value(s, "afd_exchange_seconds_count", **lab, stage="0") == 1
    assert _value(s, "afd_exchange_seconds_count", **lab, stage="1") == 2
    assert _value(s, "afd_exchange_seconds_bucket", **lab, stage="0", le="2.5e-05") == 0
    assert _value(s, "afd_exchange_seconds_bucket", **lab, stage="0", le="5e-05") == 1
    assert _value(s, "afd_exchange_seconds_bucket", **lab, stage="1", le="0.25") == 1
    assert _value(s, "afd_exchange_seconds_bucket", **lab, stage="1", le="10.0") == 1
    assert _value(s, "afd_exchange_seconds_bucket", **lab, stage="1", le="+Inf") == 2
    assert _value(s, "afd_exchange_seconds_sum", **lab, stage="1") == pytest.approx(99.2)
    assert _value(s, "afd_ffn_compute_seconds_count", **lab) == 1
    assert _value(s, "afd_ffn_batch_tokens_sum", **lab) == 7
    assert _value(s, "afd_expert_rows_total", **lab, expert="4") == 3
    assert _value(s, "afd_expert_rows_total", **lab, expert="5") == 1
    assert _value(s, "afd_expert_rows_total", **lab, expert="6") == 5
    assert _value(s, "afd_errors_total", **lab, type="PeerLostError") == 1
    assert _value(s, "afd_peer_state", **lab, state="connected") == 1
    assert _value(s, "afd_peer_state", **lab, state="connecting") == 0


def test_histogram_bounds_are_the_documented_ones():
    hub = MetricsHub()
    hub.recorder(connector="c", role="attention", rank=0, port=1, num_stages=1)
    s = _samples(_exposition(hub))
    les = [lab["le"] for n, lab, _ in s if n == "afd_exchange_seconds_bucket"]
    assert les == [*(repr(b) for b in EXCHANGE_BUCKETS_S), "+Inf"]
    # attention ranks do not compute FFN: no compute or batch series for them
    assert not [n for n, _, _ in s if n.startswith(("afd_ffn_compute", "afd_ffn_batch"))]


def test_failure_marks_peers_lost_or_closed():
    hub = MetricsHub()
    a = hub.recorder(connector="c", role="ffn", rank=0, port=1, num_stages=1)
    b = hub.recorder(connector="c", role="ffn", rank=0, port=2, num_stages=1)
    a.record_failure(PeerLostError("x"))
    b.record_failure(AFDConfigError("y", key="k"))
    assert (a.peer_state, b.peer_state) == ("lost", "closed")
    assert a.errors == {"PeerLostError": 1} and b.errors == {"AFDConfigError": 1}
    a.record_failure(PeerLostError("x"))  # the same failure seen again by an outer caller: the world ended once
    assert a.errors == {"PeerLostError": 1}


def test_collector_joins_a_foreign_registry():
    """What vLLM's /metrics (prometheus_client.REGISTRY of its process) gets after one register call."""
    from prometheus_client import CollectorRegistry, generate_latest

    hub = MetricsHub()
    hub.recorder(connector="c", role="ffn", rank=0, port=1, num_stages=1).observe_step(3)
    reg = CollectorRegistry()
    reg.register(collector(hub))
    assert _value(_samples(generate_latest(reg).decode()), "afd_steps_total", port="1") == 1


def _exposition(hub: MetricsHub) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry(hub, process=False)).decode()


def test_recording_is_cheap():
    """Not a timing assertion (benchmarks measure): the hot path allocates nothing per exchange."""
    import tracemalloc

    rec = MetricsHub().recorder(connector="c", role="attention", rank=0, port=1, num_stages=2)
    for _ in range(100):
        rec.observe_exchange(1, 1e-4, 8192, 8192)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for _ in range(10_000):
        rec.observe_exchange(1, 1e-4, 8192, 8192)
    grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "lineno") if "metrics.py" in str(d))
    tracemalloc.stop()
    assert grown < 1024, grown  # a float sum and int counters: no per-call objects kept


# --- config and the endpoint ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"), [("metrics_port", 0), ("metrics_port", "http"), ("metrics_port", 70000), ("metrics_host", "")]
)
def test_metrics_keys_are_validated(key, value):
    with pytest.raises(AFDConfigError) as err:
        parse_config({"role": "ffn", key: value})
    assert err.value.key == f"afd.{key}" and repr(value) in str(err.value)


def test_endpoint_address_follows_the_role():
    assert metrics_address(parse_config({"role": "ffn"})) is None
    assert metrics_address(parse_config({"role": "ffn", "host": "127.0.0.1", "metrics_port": 9100})) == (
        "127.0.0.1",
        9100,
    )
    # the local address on the route to afd.host: afd.host itself on the host that owns it
    assert metrics_address(parse_config({"role": "attention", "host": "127.0.0.1", "metrics_port": 9101})) == (
        "127.0.0.1",
        9101,
    )
    cfg = parse_config({"role": "attention", "metrics_port": 9102, "metrics_host": "127.0.0.2"})
    assert metrics_address(cfg) == ("127.0.0.2", 9102)


def test_health_and_readiness_follow_the_peers():
    hub = MetricsHub()
    with OpsServer("127.0.0.1", free_port_block(1), hub) as ops:
        base = "http://{}:{}".format(*ops.address)
        assert _get(base + "/healthz") == (200, "alive\n")
        code, body = _get(base + "/readyz")
        assert code == 503 and json.loads(body) == {"ready": False, "worlds": []}  # no world yet: not ready
        rec = hub.recorder(connector="c", role="ffn", rank=0, port=7, num_stages=1)
        assert _get(base + "/readyz")[0] == 503
        rec.set_peer_state("connected")
        code, body = _get(base + "/readyz")
        assert code == 200 and json.loads(body)["worlds"][0]["peers"] == "connected"
        other = hub.recorder(connector="c", role="ffn", rank=0, port=8, num_stages=1)
        assert _get(base + "/readyz")[0] == 503  # every world must be connected
        other.set_peer_state("connected")
        assert _get(base + "/readyz")[0] == 200
        rec.set_peer_state("lost")
        code, body = _get(base + "/readyz")
        assert code == 503 and [w["peers"] for w in json.loads(body)["worlds"]] == ["lost", "connected"]
        code, text = _get(base + "/metrics")
        assert code == 200 and "afd_peer_state" in text and "process_open_fds" in text
        assert _get(base + "/nope")[0] == 404


def test_endpoint_port_in_use_is_a_config_error():
    hub = MetricsHub()
    with OpsServer("127.0.0.1", free_port_block(1), hub) as ops:
        with pytest.raises(AFDConfigError) as err:
            OpsServer("127.0.0.1", ops.address[1], hub)
    assert err.value.key == "afd.metrics_port" and str(ops.address[1]) in str(err.value)


def test_endpoint_close_releases_the_port():
    port = free_port_block(1)
    OpsServer("127.0.0.1", port, MetricsHub()).close()
    OpsServer("127.0.0.1", port, MetricsHub()).close()  # bindable again at once


# --- both CLI roles, scraped while they run ----------------------------------------------------------

AFD = [sys.executable, "-m", "afd_sdk.cli"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    pytest.importorskip("transformers", reason="the runtime needs the [hf] extra")
    from afd_sdk.integrations.transformers import save_tiny_checkpoint

    return save_tiny_checkpoint("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("qwen"))


def _steps(text: str, role: str) -> float:
    return sum(v for n, lab, v in _samples(text) if n == "afd_steps_total" and lab["role"] == role)


def _wait_for(url: str, ok, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = _get(url)
            if ok(*last):
                return last[1]
        except OSError as exc:  # not listening yet
            last = exc
        time.sleep(0.05)
    raise AssertionError(f"{url} never answered as expected; last: {str(last)[-3000:]}")


@pytest.mark.multiprocess
def test_ffn_and_attention_endpoints_during_a_run(qwen_dir):
    """FFN serves two worlds: world 1 runs and ends, world 2 waits; both endpoints are scraped meanwhile."""
    base, mport = free_port_block(32), free_port_block(2)
    cfg = {"connector": "zmq", "timeout_s": 30}
    ffn = subprocess.Popen(
        [
            *AFD,
            "ffn",
            "serve",
            "--model",
            str(qwen_dir),
            "--config",
            json.dumps(cfg),
            "--world-port",
            str(base),
            "--world-port",
            str(base + 16),
            "--metrics-port",
            str(mport),
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    gen = None
    try:
        ffn_url = f"http://127.0.0.1:{mport}"
        _wait_for(ffn_url + "/healthz", lambda c, b: c == 200)
        body = json.loads(_wait_for(ffn_url + "/readyz", lambda c, b: c == 503 and '"worlds": [{' in b))
        assert [w["peers"] for w in body["worlds"]] == ["connecting", "connecting"]

        steps, prompt = 150, [5, 6, 7]
        gen = subprocess.Popen(
            [
                *AFD,
                "attention",
                "generate",
                "--model",
                str(qwen_dir),
                "--config",
                json.dumps({**cfg, "port": base}),
                "--prompt-ids",
                ",".join(map(str, prompt)),
                "--max-new-tokens",
                str(steps),
                "--metrics-port",
                str(mport + 1),
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # the attention rank's own endpoint, while it generates
        text = _wait_for(f"http://127.0.0.1:{mport + 1}/metrics", lambda c, b: c == 200 and _steps(b, "attention") > 0)
        s = _samples(text)
        assert _value(s, "afd_peer_state", role="attention", state="connected") == 1
        assert _value(s, "afd_exchange_seconds_count", role="attention", stage="0") >= 3
        assert _value(s, "afd_sent_bytes_total", role="attention") > 0
        out, err = gen.communicate(timeout=120)
        assert gen.returncode == 0, err[-3000:]
        assert [len(t) for t in json.loads(out)["tokens"]] == [steps]

        # world 1 ended with its goodbye, world 2 still waits: the FFN's figures for world 1 are final
        closed = {"role": "ffn", "port": str(base), "state": "closed"}
        text = _wait_for(
            ffn_url + "/metrics", lambda c, b: c == 200 and _value(_samples(b), "afd_peer_state", **closed)
        )
        s = _samples(text)
        w1 = {"role": "ffn", "port": str(base)}
        layers, hidden = 3, 32
        tokens = len(prompt) + steps - 1  # the prompt, then one token per step
        assert _value(s, "afd_steps_total", **w1) == steps
        assert _value(s, "afd_step_tokens_sum", **w1) == tokens
        assert _value(s, "afd_exchange_seconds_count", **w1, stage="0") == steps * layers
        assert _value(s, "afd_ffn_compute_seconds_count", **w1) == steps * layers
        assert _value(s, "afd_ffn_batch_tokens_sum", **w1) == tokens * layers
        assert _value(s, "afd_received_bytes_total", **w1) == tokens * layers * hidden * 4  # float32, no extras
        assert _value(s, "afd_sent_bytes_total", **w1) == tokens * layers * hidden * 4
        assert _value(s, "afd_peer_state", role="ffn", port=str(base + 16), state="connecting") == 1
        assert _get(ffn_url + "/readyz")[0] == 503

        end = subprocess.run(
            [
                *AFD,
                "attention",
                "generate",
                "--model",
                str(qwen_dir),
                "--config",
                json.dumps({**cfg, "port": base + 16}),
                "--prompt-ids",
                "1,2",
                "--max-new-tokens",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert end.returncode == 0, end.stderr[-3000:]
        _, err = ffn.communicate(timeout=60)
        assert ffn.returncode == 0, err[-3000:]
        assert f"http://127.0.0.1:{mport}/metrics" in err
    finally:
        for p in (ffn, gen):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.mark.multiprocess
def test_routed_dispatch_ffn_rank_exports_per_expert_rows(qwen_dir):
    """CAM: each FFN rank counts the rows its own routed experts received, by global expert id."""
    from afd_sdk.runtime.session import validate_role

    cfg = {
        "connector": "CAMAsyncAFDConnector",
        "port": free_port_block(16),
        "timeout_s": 30,
        "num_ffn_ranks": 2,
        "compute_gate_on_attention": True,
    }
    mport = free_port_block(2)
    _, _, adapter, _ = validate_role({**cfg, "role": "ffn"}, qwen_dir)
    num_experts = adapter.moe_layout().num_experts
    ffns = [
        subprocess.Popen(
            [
                *AFD,
                "ffn",
                "serve",
                "--model",
                str(qwen_dir),
                "--config",
                json.dumps(cfg),
                "--rank",
                str(r),
                "--metrics-port",
                str(mport + r),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    gen = subprocess.Popen(
        [
            *AFD,
            "attention",
            "generate",
            "--model",
            str(qwen_dir),
            "--config",
            json.dumps(cfg),
            "--prompt-ids",
            "5,6,7,8",
            "--max-new-tokens",
            "200",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen: list[set[int]] = []
        for r in range(2):

            def rows(c: int, b: str) -> bool:
                return c == 200 and any(n == "afd_expert_rows_total" for n, _, _ in _samples(b))

            s = _samples(_wait_for(f"http://127.0.0.1:{mport + r}/metrics", rows))
            experts = {int(lab["expert"]) for n, lab, v in s if n == "afd_expert_rows_total" and v > 0}
            assert experts and experts <= set(range(num_experts)), experts
            assert _value(s, "afd_peer_state", role="ffn", state="connected") == 1
            seen.append(experts)
        assert not seen[0] & seen[1]  # each rank serves its own experts
        assert max(seen[0]) < min(seen[1])  # placed in contiguous blocks, rank 0 first
        _, err = gen.communicate(timeout=120)
        assert gen.returncode == 0, err[-3000:]
    finally:
        for p in (*ffns, gen):
            if p.poll() is None:
                p.kill()
            p.wait(10)
