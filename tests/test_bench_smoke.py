"""The benchmark commands run and report what they promise (numbers are not asserted: benchmarks, not timed tests)."""

import json

import pytest

from afd_sdk.cli import main

pytestmark = pytest.mark.multiprocess


def _bench_json(capsys, *args: str) -> dict:
    """Run ``afd bench connector --connector zmq --sizes 8K --iters 20 ARGS --json``; its JSON."""
    code = main(["bench", "connector", "--connector", "zmq", "--sizes", "8K", "--iters", "20", *args, "--json"])
    out, _ = capsys.readouterr()
    assert code == 0
    return json.loads(out)


def test_bench_connector_json_reports_ratios(capsys):
    code = main(
        [
            "bench",
            "connector",
            "--connector",
            "zmq",
            "--sizes",
            "8K,64K",
            "--iters",
            "20",
            "--raw",
            "zmq,memcpy",
            "--json",
        ]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    data = json.loads(out)
    assert data["connector"] == "ZmqAFDConnector" and [r["size"] for r in data["rows"]] == [8192, 65536]
    for row in data["rows"]:
        for key in ("connector", "zmq", "memcpy"):
            assert row[key]["median_us"] > 0 and row[key]["p90_us"] >= row[key]["median_us"]
        assert row["ratio_zmq"] == pytest.approx(row["connector"]["median_us"] / row["zmq"]["median_us"])
        # each layer's first use ran in a block of its own, outside the timed ten
        assert row["connector_first_use"]["n"] * 10 == row["connector"]["n"]
        assert row["connector_first_use"]["median_us"] > 0


@pytest.mark.parametrize(("connector", "baselines"), [("zmq", ["zmq", "wire"]), ("p2p", ["gloo", "posted"])])
def test_bench_connector_measures_the_connector_against_its_own_data_path_by_default(capsys, connector, baselines):
    """zmq and p2p run their contract-free data path beside the raw transport: copied and zero-copy sizes."""
    code = main(["bench", "connector", "--connector", connector, "--sizes", "8K,512K", "--iters", "20", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0
    data = json.loads(out)
    assert data["baselines"] == baselines
    assert data["wire"] in (("native", "pyzmq") if connector == "zmq" else ("native", "python"))
    for row in data["rows"]:
        for key in baselines:
            assert row[key]["median_us"] > 0 and row[key]["n"] > 0
            assert row[f"ratio_{key}"] == pytest.approx(row["connector"]["median_us"] / row[key]["median_us"])


def test_bench_connector_rejects_bad_sizes(capsys):
    assert main(["bench", "connector", "--connector", "zmq", "--sizes", "3K"]) == 2
    assert "multiple of 4K" in capsys.readouterr().err


def test_bench_pipeline_json(capsys):
    pytest.importorskip("transformers", reason="the pipeline benchmark needs the [hf] extra")
    code = main(["bench", "pipeline", "--requests", "2", "--tokens", "8", "--repeat", "3", "--layers", "2", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0
    data = json.loads(out)
    assert data["layers"] == 2
    for key in (
        "t_attn_ms",
        "t_ffn_ms",
        "t1_ms",
        "t2_ms",
        "overlap_efficiency",
        "sdk_overhead_us_per_layer",
        "ffn_compute_ms_1_stage",
        "ffn_compute_ms_2_stages",
        "overlap_efficiency_in_run",
        "t_attn_micro_ms",
        "t_ffn_micro_ms",
        "overlap_efficiency_whole_batch",
        "ffn_serve_ms_per_step_2_stages",
    ):
        assert key in data
    # the headline's bound is the micro-batched work (NaN when T1 is not above it: no overlap to measure)
    t1, t2 = data["t1_ms"], data["t2_ms"]
    bound = max(data["t_attn_micro_ms"], data["t_ffn_micro_ms"])
    expected = (t1 - t2) / (t1 - bound) if t1 > bound else float("nan")
    assert data["overlap_efficiency"] == pytest.approx(expected, nan_ok=True)
    # the FFN's compute is part of its server's time; both are means over every step (warm-up steps included), so
    # the attention side's median step time T2 is no bound for them (CI once read 14.52 ms of compute against 14.03)
    assert 0 < data["ffn_compute_ms_2_stages"] < data["ffn_serve_ms_per_step_2_stages"]
    assert data["t1_ms"] > 0 and data["t2_ms"] > 0 and data["sdk_overhead_us_per_layer"] > 0


def test_bench_shm_reports_the_raw_ring_and_idle_cpu(capsys):
    code = main(
        ["bench", "connector", "--connector", "shm", "--sizes", "8K", "--iters", "20", "--raw", "shm,memcpy", "--json"]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    data = json.loads(out)
    assert data["baselines"] == ["shm", "memcpy"]
    (row,) = data["rows"]
    assert row["shm"]["median_us"] > 0 and row["connector"]["median_us"] > 0
    assert row["ratio_shm"] == pytest.approx(row["connector"]["median_us"] / row["shm"]["median_us"])
    assert 0 <= data["ffn_idle_cpu_pct"] <= 200 and data["idle_s"] > 0


def test_bench_connector_rejects_unknown_raw_baseline(capsys):
    assert main(["bench", "connector", "--connector", "zmq", "--raw", "rdma"]) == 2
    err = capsys.readouterr().err
    assert "error: --raw rdma is not a baseline of ZmqAFDConnector; expected some of zmq, gloo, memcpy, wire" in err
    assert "benchmarking" not in err  # rejected before anything starts
    # a connector's own raw transport (declared in raw_baselines) is offered for that connector only
    assert main(["bench", "connector", "--connector", "zmq", "--raw", "shm"]) == 2
    assert main(["bench", "connector", "--connector", "shm", "--raw", "rdma"]) == 2
    assert "expected some of zmq, gloo, memcpy, shm" in capsys.readouterr().err


def test_bench_connector_metrics_column_records_every_exchange(capsys):
    data = _bench_json(capsys, "--metrics")
    (row,) = data["rows"]
    assert row["connector+metrics"]["median_us"] > 0
    assert row["metrics_delta_us"] == pytest.approx(
        row["connector+metrics"]["median_us"] - row["connector"]["median_us"]
    )
    assert data["recording_ns"]["attention"] > 0 and data["recording_ns"]["ffn"] > 0
    # 10 blocks of per_block + 2 round trips, warm-ups included: both ranks recorded the same exchanges
    assert data["recorded_exchanges"]["attention"] == data["recorded_exchanges"]["ffn"] == 10 * (2 + 2)


def test_bench_soak_reports_usage_of_both_processes(capsys):
    pytest.importorskip("transformers", reason="the soak runs the tiny model: the [hf] extra")
    code = main(["bench", "soak", "--connector", "zmq", "--steps", "40", "--warmup", "5", "--json"])
    out, _ = capsys.readouterr()
    data = json.loads(out)
    (row,) = data["rows"]
    assert row["connector"] == "ZmqAFDConnector" and row["steps"] == row["ffn_steps"] == 40
    assert row["exchanges"] == (40 + 5) * 3 * 2  # (steps + warm-up) x layers x stages, from the attention metrics
    for side in ("attention", "ffn"):
        u = row[side]
        assert u["start"]["rss_bytes"] > 0 and u["start"]["fds"] > 0 and u["start"]["threads"] > 0
        assert u["growth"]["rss_bytes"] == u["end"]["rss_bytes"] - u["start"]["rss_bytes"]
    assert code == (0 if all(row[s]["flat"] for s in ("attention", "ffn")) else 1)


def test_bench_soak_refuses_routed_dispatch(capsys):
    assert main(["bench", "soak", "--connector", "cam", "--steps", "10"]) == 2
    assert "point-to-point" in capsys.readouterr().err


def test_bench_connector_profile_breaks_the_round_trip_down(capsys):
    data = _bench_json(capsys, "--profile")
    (row,) = data["rows"]
    conn, raw = row["profile"]["connector"], row["profile"]["zmq"]
    for part in ("send_us", "send_cpu_us", "recv_us", "recv_cpu_us", "rt_us"):
        assert conn["attention"][part] > 0
    # on-CPU time of a call never exceeds its wall time (beyond clock granularity)
    assert conn["attention"]["send_cpu_us"] <= conn["attention"]["send_us"] + 2
    assert conn["ffn"]["recv_cpu_us"] <= conn["ffn"]["recv_us"] + 2
    # a raw round trip is one call: no per-call parts, but the same per-trip accounting
    assert "send_us" not in raw["attention"] and raw["attention"]["rt_us"] > 0
    for side in ("attention", "ffn"):
        for prof in (conn, raw):
            assert prof[side]["thread_cpu_us"] > 0 and prof[side]["voluntary_switches"] >= 0
    # the function breakdown shows the connector's own code, and none of it in the raw loop
    conn_functions = [f["function"] for f in conn["attention"]["functions"] + conn["ffn"]["functions"]]
    raw_functions = [f["function"] for f in raw["attention"]["functions"] + raw["ffn"]["functions"]]
    assert any("zmq/connector.py" in f for f in conn_functions), conn_functions
    assert not any("zmq/connector.py" in f for f in raw_functions), raw_functions
    for side in ("attention", "ffn"):
        wake = data["wake_penalty"][side]
        assert (
            wake["hot_us"] > 0
            and wake["after_sleep_us"] > 0
            and wake["ratio"] == pytest.approx(wake["after_sleep_us"] / wake["hot_us"])
        )


def test_bench_connector_profile_table(capsys):
    code = main(["bench", "connector", "--connector", "p2p", "--sizes", "8K", "--iters", "20", "--profile"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "where one round trip goes" in out and "raw gloo" in out
    assert "attention: recv call, wall (waits for FFN)" in out and "wake penalty (ffn rank)" in out
    assert "under cProfile, connector attention: " in out


def test_pipeline_modes_take_turns():
    from afd_sdk.bench.pipeline_bench import interleaved_medians

    calls: list[str] = []
    modes = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    medians = interleaved_medians(modes, repeat=3, warmup=1)
    assert set(medians) == {"a", "b", "c"} and all(v >= 0 for v in medians.values())
    # warm-up once each, then every round runs every mode once, starting one mode later each round
    assert calls == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_bench_pipeline_refuses_zero_layers_before_any_work():
    from afd_sdk.bench.pipeline_bench import run_pipeline_benchmark
    from afd_sdk.errors import AFDConfigError

    with pytest.raises(AFDConfigError, match="layers=0; expected an int >= 1") as err:
        run_pipeline_benchmark(layers=0)
    assert err.value.key == "layers"
