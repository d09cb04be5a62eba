"""``afd plan calibrate --engine vllm`` and ``afd plan validate`` of its profile: vLLM's own kernels and engines,
through the CLI as users run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; run the tier with scripts/bootstrap-vllm.sh")

from afd_sdk.integrations.vllm.demo import WORLD_ENV
from afd_sdk.plan.calibrate import overhead_worlds
from afd_sdk.plan.profile import Profile

pytestmark = pytest.mark.timeout(900)  # calibrations and validations of vLLM worlds: minutes on 2 cores

#: the validated configurations' worst |error| allowed (the model must also beat every constant prediction).
#: One run of each world is not enough on this shared 2-core machine: a CI run read a 1A1F b2 calibration world
#: at 11.7 ms between b1's 6.8 and b8's 19.8 and over-predicted b1 by 51 %; every world here runs twice in
#: turns and the fastest run counts (``--world-rounds 2``, ``--rounds 2``); errors are corrected for the host's drift
#: since calibration (``host_drift``)
WORST_BOUND = 0.45
ROUNDS = "2"


def _afd(*args: str, tmp_path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **WORLD_ENV, "VLLM_CACHE_ROOT": str(tmp_path / "cache")}
    return subprocess.run(
        [sys.executable, "-m", "afd_sdk.cli", *args], capture_output=True, text=True, env=env, timeout=600
    )


def _calibrate(tmp_path, *args: str) -> Profile:
    """``afd plan calibrate --engine vllm --layers 2 ARGS`` into ``tmp_path/profile.json``, and the checks every
    vLLM calibration must pass: the curves grow with the work and the overheads come from real worlds of vLLM
    engines (1A1F at the smallest and the middle batch, the smaller excess fitted; two pairs at once)."""
    out = tmp_path / "profile.json"
    res = _afd("plan", "calibrate", "--engine", "vllm", "--layers", "2", *args, "--out", str(out), tmp_path=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "1A1F step measured vs modelled: 1A1F 1S b1" in res.stdout, res.stdout
    profile = Profile.load(out)
    assert profile.engine == "vllm" and profile.dispatch == "fan_in" and profile.num_layers == 2
    # a null connector's FFN (zeros, no compute) or a hook that timed nothing would break these
    points = [x for x, _ in profile.attention_us.points]
    assert profile.attention_us(points[-1]) > profile.attention_us(points[0]) > 0, profile.attention_us.points
    ffn_points = [x for x, _ in profile.ffn_us.points]
    assert profile.ffn_us(ffn_points[-1]) > profile.ffn_us(ffn_points[0]) > 0, profile.ffn_us.points
    assert profile.step_overhead_us > 0 and profile.host.concurrency_slowdown >= 1.0
    fitted = profile.measured["overhead_step"]
    assert fitted in overhead_worlds(profile.measured, decode=False), profile.measured
    assert profile.step_overhead_us == pytest.approx((fitted["measured_ms"] - fitted["modelled_ms"]) * 1000)
    return profile


def test_calibrate_with_vllm_kernels_then_plan(tmp_path):
    """A small calibration (two batches, one round of worlds): what CI can afford of the validated one below."""
    profile = _calibrate(tmp_path, "--batch", "1,4", "--max-group", "2", "--context", "32,160", "--world-rounds", "1")
    assert [x for x, _ in profile.attention_us.points] == [16.0, 64.0]
    assert [w["deployment"] for w in overhead_worlds(profile.measured, decode=False)] == ["1A1F 1S b1", "1A1F 1S b4"]
    assert profile.measured["concurrency_step"]["deployment"] == "2A2F 1S b4"
    assert profile.decode is not None and profile.decode.contexts == [32, 160]
    # a decode step of 4 requests over 160 tokens of context reads twenty times the KV cache of one over 32
    assert profile.decode.attention_us[160](4) > profile.decode.attention_us[32](1)
    out = tmp_path / "profile.json"
    res = _afd("plan", "--profile", str(out), "--attention", "1-2", "--ffn", "1", "--context", "96", "--json",
               tmp_path=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["best"] is not None
    # AFD inside vLLM runs one micro-batch stage: refused before any engine starts
    res = _afd("plan", "validate", "--profile", str(out), "--stages", "2", "--batch", "2", tmp_path=tmp_path)
    assert res.returncode == 2 and "with a vLLM-engine profile; expected 1" in res.stderr, res.stderr[-2000:]


# CI time (six minutes or more of vLLM worlds on 2 cores): CI runs the small calibration above and validates the
# reference runtime's calibration against its real worlds (tests/test_plan_validate.py); vLLM sweeps are in
# docs/planning.md
@pytest.mark.slow
def test_calibrate_with_vllm_kernels_then_validate_against_vllm_worlds(tmp_path):
    profile = _calibrate(
        tmp_path, "--batch", "1,2,8", "--max-group", "3", "--context", "32,160", "--world-rounds", ROUNDS
    )
    out = tmp_path / "profile.json"
    assert [x for x, _ in profile.attention_us.points] == [16.0, 32.0, 128.0]
    assert profile.ffn_us(384) > profile.ffn_us(16) > 0
    # the step overhead's worlds (``_calibrate`` checked that the fitted one is among them), the drift anchors below
    anchors = overhead_worlds(profile.measured, decode=False)
    assert [w["deployment"] for w in anchors] == ["1A1F 1S b1", "1A1F 1S b2"], profile.measured
    assert profile.measured["concurrency_step"]["deployment"] == "2A2F 1S b2"
    assert profile.decode is not None and profile.decode.contexts == [32, 160]
    assert [x for x, _ in profile.decode.ffn_us.points] == [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 24.0]
    # a decode step of 8 requests over 160 tokens of context reads forty times the KV cache of one over 32
    assert profile.decode.attention_us[160](8) > profile.decode.attention_us[32](1)
    # the smallest and the largest step of the profile's range, each a real world of vLLM engines
    report = tmp_path / "validate.json"
    res = _afd(
        "plan", "validate", "--profile", str(out), "--attention", "1,2", "--ffn", "1", "--batch", "1,8",
        "--repeat", "5", "--rounds", ROUNDS, "--out", str(report), tmp_path=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    result = json.loads(report.read_text())
    assert {r["label"] for r in result["rows"]} == {"1A1F 1S b1", "1A1F 1S b8", "2A1F 1S b1", "2A1F 1S b8"}
    shown = json.dumps({**result, "profile": profile.measured}, indent=1)
    runs = int(ROUNDS)
    assert all(
        len(r["measured_runs_ms"]) == runs and r["measured_ms"] == min(r["measured_runs_ms"]) for r in result["rows"]
    )
    # corrected for the host's drift since calibration, measured on calibration's own 1A1F worlds each round (a
    # CI run read the 1A1F b1 world at 7.7 ms in calibration and 10.8 ms minutes later in validation: every row
    # 20-48 % under-predicted)
    drift = result["host_drift"]
    assert [(w["deployment"], w["calibrated_ms"]) for w in drift["worlds"]] == [
        (c["deployment"], c["measured_ms"]) for c in anchors
    ], shown
    assert all(len(w["measured_runs_ms"]) == runs for w in drift["worlds"]), shown
    # at calibration's speed or at the speed measured now (tests/test_plan_validate.py's ``_assert_tracks``)
    worst = min(result["worst_abs_error"], result["drift_corrected_worst_abs_error"])
    assert worst <= WORST_BOUND, shown
    # a constant in place of the model, scaled or not, is off by at least this over the same measurements
    assert worst < result["constant_worst_abs_error"], shown
