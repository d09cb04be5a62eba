"""`afd bench serve`'s arithmetic and validation (the runs themselves: tests/vllm_tier, and the issue note)."""

from __future__ import annotations

import numpy as np
import pytest

from afd_sdk.bench.serve_bench import ServeBenchOptions, afd_breakdown, client_metrics, validate_options
from afd_sdk.cli import main
from afd_sdk.errors import AFDConfigError


def _record(starts, latencies, ttfts, outs, errors=None):
    return {
        "start_times": starts,
        "latencies": latencies,
        "ttfts": ttfts,
        "output_lens": outs,
        "errors": errors or [""] * len(starts),
    }


def test_client_metrics_match_vllm_bench_serve_definitions():
    rng = np.random.default_rng(0)
    n = 37
    starts = np.sort(rng.uniform(0, 2, n))
    ttfts = rng.uniform(0.05, 0.3, n)
    outs = rng.integers(1, 30, n)
    latencies = ttfts + (outs - 1) * rng.uniform(0.01, 0.02, n)
    m = client_metrics([_record(starts.tolist(), latencies.tolist(), ttfts.tolist(), outs.tolist())])
    tpots = [(lat - t) / (o - 1) for lat, t, o in zip(latencies, ttfts, outs, strict=True) if o > 1]
    assert m["ttft_ms"]["p99"] == pytest.approx(1000 * np.percentile(ttfts, 99))
    assert m["ttft_ms"]["p50"] == pytest.approx(1000 * np.percentile(ttfts, 50))
    assert m["tpot_ms"]["p99"] == pytest.approx(1000 * np.percentile(tpots, 99))
    window = max(starts + latencies) - min(starts)
    assert m["output_tok_s"] == pytest.approx(outs.sum() / window)
    assert m["completed"] == n and m["failed"] == 0 and m["overlap"] == 1.0


def test_two_clients_merge_into_one_window_and_failed_requests_are_counted_apart():
    a = _record([0.0, 0.5], [1.0, 1.0], [0.1, 0.1], [10, 10])
    b = _record([0.2, 0.3], [2.8, 0.4], [0.2, 0.1], [20, 5], errors=["", "boom"])
    m = client_metrics([a, b])
    assert m["completed"] == 3 and m["failed"] == 1 and m["output_tokens"] == 40
    assert m["duration_s"] == pytest.approx(3.0)  # from 0.0 to b's first request ending at 3.0
    # a: 20 tokens over 0.0-1.5; b: 20 over 0.2-3.0 (its failed request counts no tokens)
    assert m["output_tok_s"] == pytest.approx(20 / 1.5 + 20 / 2.8)
    assert m["overlap"] == pytest.approx((1.5 - 0.2) / 3.0)


def _samples(**values):
    return {(name, tuple(sorted(labels.items()))): v for (name, labels), v in values.items()}


def test_breakdown_is_the_delta_over_the_load():
    def ffn(calls, tokens, compute):
        return {
            ("afd_ffn_batch_tokens_count", (("port", "1"), ("role", "ffn"))): calls,
            ("afd_ffn_batch_tokens_sum", (("port", "1"), ("role", "ffn"))): tokens,
            ("afd_ffn_compute_seconds_sum", (("port", "1"), ("role", "ffn"))): compute,
        }

    def attn(n, secs):
        return {
            ("afd_exchange_seconds_count", (("role", "attention"), ("stage", "0"))): n,
            ("afd_exchange_seconds_sum", (("role", "attention"), ("stage", "0"))): secs,
        }

    b = afd_breakdown(
        ffn(10, 50, 1.0), ffn(110, 850, 1.1), [attn(5, 1.0), attn(5, 1.0)], [attn(105, 1.2), attn(105, 1.2)]
    )
    assert b["ffn_calls"] == 100 and b["ffn_batch_tokens_mean"] == pytest.approx(8.0)
    assert b["attention_exchanges"] == 200
    assert b["exchange_us_mean"] == pytest.approx(2000.0) and b["ffn_compute_us_mean"] == pytest.approx(1000.0)
    assert b["exchange_other_us_mean"] == pytest.approx(1000.0)


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        (ServeBenchOptions(setups=("dp4",)), "setup 'dp4' is unknown; expected one of one-engine, dp2, two-worlds"),
        (ServeBenchOptions(num_prompts=7), "two-worlds splits the load"),
        (ServeBenchOptions(connectors=("nope",)), "connector 'nope' is not registered"),
    ],
)
def test_options_are_checked_before_any_process(opts, match):
    with pytest.raises(AFDConfigError, match=match):
        validate_options(opts)


def test_cli_refuses_a_bad_setup_with_exit_2_and_starts_nothing(tmp_path, capsys):
    code = main(["bench", "serve", "--setup", "dp4", "--work-dir", str(tmp_path / "w")])
    assert code == 2 and "setup 'dp4' is unknown" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_the_table_prints_every_row(capsys):
    from afd_sdk.cli.bench import _print_serve

    run = {"output_tok_s": 100.0, "ttft_ms": {"p50": 10, "p99": 20}, "tpot_ms": {"p50": 5, "p99": 6}}
    afd = {
        **run,
        "afd": {
            "ffn_batch_tokens_mean": 7.5,
            "exchange_us_mean": 900,
            "ffn_compute_us_mean": 600,
            "exchange_other_us_mean": 300,
        },
    }
    rows = [
        {"setup": s, "connector": "zmq", "native_engines": 1, "native": run, "afd": afd, "ratio": {"output_tok_s": 0.9}}
        for s in ("one-engine", "dp2")
    ]
    load = {"input_len": 24, "output_len": 24, "num_prompts": 32, "max_concurrency": 8}
    _print_serve({"arch": "Qwen3MoeForCausalLM", "load": load, "rows": rows})
    out = capsys.readouterr().out
    assert out.count("0.90×") == 2 and "900 (600 + 300)" in out


class _FakeBench:
    """Native and AFD runs whose speeds drift by round, as a shared host's do."""

    def __init__(self, opts, say):
        self.model, self.engine, self.calls = "m", {}, []
        self.native_speed = iter([1000.0, 500.0, 2000.0])
        self.afd_speed = iter([900.0, 400.0, 1900.0])

    def native(self, engines):
        self.calls.append("native")
        return {"output_tok_s": next(self.native_speed), "ttft_ms": {"p50": 1}, "tpot_ms": {"p50": 1, "p99": 1}}

    def afd(self, connector, setup):
        self.calls.append(connector)
        return {"output_tok_s": next(self.afd_speed), "ttft_ms": {"p50": 1}, "tpot_ms": {"p50": 1, "p99": 1}}


def test_rounds_run_in_turns_and_each_afd_run_is_compared_with_its_own_rounds_native(monkeypatch):
    import afd_sdk.bench.serve_bench as sb

    made = []
    monkeypatch.setattr(sb, "_Bench", lambda opts, say: made.append(_FakeBench(opts, say)) or made[-1])
    result = sb.run_serve_bench(ServeBenchOptions(setups=("one-engine",), repeats=3))
    assert made[0].calls == ["native", "zmq"] * 3
    (row,) = result["rows"]
    assert row["round_ratios"] == pytest.approx([0.9, 0.8, 0.95])
    assert row["round"] == 0 and row["ratio"]["output_tok_s"] == pytest.approx(0.9)  # the median round
    assert row["native"]["output_tok_s"] == 1000.0 and result["repeats"] == 3


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ("shm", "is not CONNECTOR=JSON"),
        ("shm=[1]", "is not CONNECTOR=JSON"),
        ("shm={bad", "is not CONNECTOR=JSON"),
        ("zmq={}", "given for 'zmq', which this run does not bench"),
        ('shm={"spin": 0}', "spin is not accepted by ShmAFDConnector; did you mean 'spin_us'"),
    ],
)
def test_extra_config_is_checked_before_any_process(tmp_path, capsys, item, match):
    argv = ["bench", "serve", "--connector", "shm", "--extra-config", item, "--work-dir", str(tmp_path / "w")]
    code = main(argv)
    assert code == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_the_table_names_a_rows_extra_config_and_its_rounds(capsys):
    from afd_sdk.cli.bench import _print_serve

    run = {"output_tok_s": 100.0, "ttft_ms": {"p50": 10, "p99": 20}, "tpot_ms": {"p50": 5, "p99": 6}}
    row = {"setup": "one-engine", "connector": "shm", "connector_extra_config": {"spin_us": 0}, "native_engines": 1}
    row.update(native=run, afd=run, ratio={"output_tok_s": 0.9}, round_ratios=[0.8, 0.9, 0.95])
    load = {"input_len": 24, "output_len": 24, "num_prompts": 32, "max_concurrency": 8}
    _print_serve({"arch": "Qwen3MoeForCausalLM", "load": load, "rows": [row], "repeats": 3})
    out = capsys.readouterr().out
    assert '{"spin_us":0}' in out and "0.90×" in out and "(0.80–0.95)" in out and "median of 3 rounds" in out
