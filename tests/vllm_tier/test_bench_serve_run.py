"""`afd bench serve` end to end: a native and an AFD `vllm serve` in turn, under vLLM's own load client."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; run the tier with scripts/bootstrap-vllm.sh")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # two deployments and a load: minutes on 2 cores


def test_one_engine_over_zmq_reports_both_runs_and_the_ffn_side(tmp_path):
    argv = [sys.executable, "-m", "afd_sdk.cli", "bench", "serve", "--setup", "one-engine", "--num-prompts", "4"]
    argv += ["--max-concurrency", "2", "--work-dir", str(tmp_path), "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (row,) = json.loads(proc.stdout)["rows"]
    for run in ("native", "afd"):
        assert row[run]["completed"] == 4 and row[run]["failed"] == 0 and row[run]["output_tok_s"] > 0, row[run]
        assert 0 < row[run]["ttft_ms"]["p50"] <= row[run]["ttft_ms"]["p99"], row[run]
    afd = row["afd"]["afd"]
    assert afd["ffn_calls"] > 0 and afd["ffn_calls"] == afd["attention_exchanges"], afd  # one world, one rank
    assert 0 < afd["ffn_compute_us_mean"] < afd["exchange_us_mean"], afd
    assert row["ratio"]["output_tok_s"] == pytest.approx(row["afd"]["output_tok_s"] / row["native"]["output_tok_s"])
