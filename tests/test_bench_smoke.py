"""The benchmark commands run and report what they promise (numbers are not asserted: benchmarks, not timed tests)."""

import json

import pytest

from afd_sdk.cli import main

pytestmark = pytest.mark.multiprocess


def test_bench_connector_json_reports_ratios(capsys):
    code = main(["bench", "connector", "--connector", "zmq", "--sizes", "8K,64K", "--iters", "20", "--raw", "zmq,memcpy",
                 "--json"])  # fmt: skip
    out, _ = capsys.readouterr()
    assert code == 0
    data = json.loads(out)
    assert data["connector"] == "ZmqAFDConnector" and [r["size"] for r in data["rows"]] == [8192, 65536]
    for row in data["rows"]:
        for key in ("connector", "zmq", "memcpy"):
            assert row[key]["median_us"] > 0 and row[key]["p90_us"] >= row[key]["median_us"]
        assert row["ratio_zmq"] == pytest.approx(row["connector"]["median_us"] / row["zmq"]["median_us"])


def test_bench_connector_rejects_bad_sizes(capsys):
    assert main(["bench", "connector", "--connector", "zmq", "--sizes", "3K"]) == 2
    assert "multiple of 4K" in capsys.readouterr().err


def test_bench_pipeline_json(capsys):
    pytest.importorskip("transformers", reason="the pipeline benchmark needs the [hf] extra")
    code = main(["bench", "pipeline", "--requests", "2", "--tokens", "8", "--repeat", "3", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0
    data = json.loads(out)
    for key in ("t_attn_ms", "t_ffn_ms", "t1_ms", "t2_ms", "overlap_efficiency", "sdk_overhead_us_per_layer"):
        assert key in data
    assert data["t1_ms"] > 0 and data["t2_ms"] > 0 and data["sdk_overhead_us_per_layer"] > 0


def test_bench_shm_reports_the_raw_ring_and_idle_cpu(capsys):
    code = main(["bench", "connector", "--connector", "shm", "--sizes", "8K", "--iters", "20", "--raw", "shm,memcpy",
                 "--json"])  # fmt: skip
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
    assert "error: --raw rdma is not a baseline of ZmqAFDConnector; expected some of zmq, gloo, memcpy" in err
    assert "benchmarking" not in err  # rejected before anything starts
    # a connector's own raw transport (declared in raw_baselines) is offered for that connector only
    assert main(["bench", "connector", "--connector", "zmq", "--raw", "shm"]) == 2
    assert main(["bench", "connector", "--connector", "shm", "--raw", "rdma"]) == 2
    assert "expected some of zmq, gloo, memcpy, shm" in capsys.readouterr().err
