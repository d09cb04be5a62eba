"""afd plan's model, profile format, hardware spec and CLI: exact arithmetic on synthetic profiles."""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import replace

import pytest

from afd_sdk.cli import main
from afd_sdk.errors import AFDConfigError
from afd_sdk.plan import Curve, Deployment, Profile, plan, predict
from afd_sdk.plan.hardware import HardwareSpec, exchange_budget
from afd_sdk.plan.profile import DecodeCosts, Host, routed_fraction
from afd_sdk.plan.published import STEPMESH_SPEC, reproduce


def _profile(**over) -> Profile:
    # 10 µs per token of attention, 20 µs per token of FFN, 1 µs per KiB round trip: easy to add up by hand
    kw = dict(
        arch="Qwen3MoeForCausalLM",
        connector="zmq",
        dispatch="fan_in",
        hidden_size=256,
        num_layers=4,
        bytes_per_element=4,
        tokens_per_request=1,
        num_experts=8,
        top_k=2,
        attention_us=Curve(((1.0, 10.0), (100.0, 1000.0))),
        ffn_us=Curve(((1.0, 20.0), (100.0, 2000.0))),
        round_trip_us=Curve(((1024.0, 1.0), (1024.0 * 100, 100.0))),
        step_overhead_us=500.0,
        host=Host(cores=1024),
    )
    kw.update(over)
    return Profile(**kw)


def test_curve_interpolates_and_extrapolates():
    c = Curve(((2.0, 10.0), (4.0, 30.0)))
    assert c(3.0) == 20.0
    assert c(8.0) == 70.0  # the last segment's slope
    assert c(1.0) == 5.0  # below the first point: never less than proportional
    with pytest.raises(AFDConfigError, match="ascending"):
        Curve(((4.0, 1.0), (2.0, 1.0)))


def test_one_stage_is_a_chain_per_layer():
    p = _profile()
    pred = predict(p, Deployment(1, 1, 1, 4))
    # m = 4 tokens: a = 40, f = 80, round trip 4 KiB -> 4 µs (half each way)
    assert pred.step_ms == pytest.approx((4 * (40 + 80 + 4) + 500) / 1000)
    assert pred.bottleneck == "ffn"
    assert pred.tokens_per_s == pytest.approx(4 / (pred.step_ms / 1000))


def test_stages_overlap_and_the_pipeline_fills_once():
    p = _profile()
    pred = predict(p, Deployment(1, 1, 2, 4))
    # m = 2: a = 20, f = 40, c = 2. FFN-bound: after the first micro-batch's attention and message, the FFN
    # works without a gap through 4 layers x 2 micro-batches, then the last answer travels back
    assert pred.step_ms == pytest.approx((20 + 1 + 8 * 40 + 1 + 500) / 1000)
    assert pred.ffn_utilisation > pred.attention_utilisation


def test_attention_bound_stages_hide_the_ffn():
    p = _profile(ffn_us=Curve(((1.0, 2.0), (100.0, 200.0))))
    pred = predict(p, Deployment(1, 1, 2, 4))
    # a = 20, f = 4, c = 2: attention works without a gap (8 x 20), then the last micro-batch's FFN round
    assert pred.step_ms == pytest.approx((8 * 20 + 1 + 4 + 1 + 500) / 1000)
    assert pred.bottleneck == "attention"


def test_fan_in_batches_the_block_and_pays_each_message():
    p = _profile()
    pred = predict(p, Deployment(3, 2, 1, 4))  # FFN rank 0 batches attention ranks 0 and 1, FFN rank 1 rank 2
    assert pred.ffn_us == pytest.approx(p.ffn_us(8))
    assert pred.exchange_us == pytest.approx(4.0)
    # per layer: a, half a round trip, the FFN's 8 tokens plus half a round trip for its second message, back
    assert pred.step_ms == pytest.approx((4 * (40 + 2 + 160 + 2 + 2) + 500) / 1000)
    with pytest.raises(AFDConfigError, match="attention >= ffn"):
        predict(p, Deployment(1, 2, 1, 4))
    with pytest.raises(AFDConfigError, match="stages <= batch"):
        predict(p, Deployment(1, 1, 3, 2))


def test_shared_cores_slow_the_processes_computing_together():
    p = _profile(host=Host(cores=2))
    pred = predict(p, Deployment(3, 1, 1, 4))
    # three attention ranks share 2 cores (40 µs of work takes 60), then the FFN batches 12 tokens alone
    per_layer = 60 + 2 + (p.ffn_us(12) + 2 * 2) + 2
    assert pred.step_ms == pytest.approx((4 * per_layer + 500 * 1.5) / 1000)
    slower = _profile(host=Host(cores=2, concurrency_slowdown=1.5))
    pred = predict(slower, Deployment(2, 2, 1, 4))
    # two independent pairs: both attention ranks, then both FFN ranks, compute at once, each 1.5x slower
    assert pred.step_ms == pytest.approx((4 * (60 + 2 + 120 + 2) + 500 * 1.5) / 1000)


def test_routed_traffic_uses_the_probability_a_token_needs_a_rank():
    assert routed_fraction(8, 2, 1) == 1.0
    assert routed_fraction(8, 2, 2) == pytest.approx(1 - math.comb(4, 2) / math.comb(8, 2))
    with pytest.raises(AFDConfigError, match="divides the experts"):
        routed_fraction(8, 2, 3)
    p = _profile(dispatch="routed")
    pred = predict(p, Deployment(1, 2, 1, 4))  # routed allows A < F
    assert pred.ffn_us == pytest.approx(p.ffn_us(2))
    assert pred.exchange_us == pytest.approx(4.0 * routed_fraction(8, 2, 2))


def test_plan_picks_the_best_per_rank_under_the_tpot_bound():
    p = _profile()
    cands = [Deployment(a, 1, s, 8) for a in (1, 2, 3) for s in (1, 2)]
    preds, best = plan(p, cands)
    assert best is max(preds, key=lambda x: x.tokens_per_s_per_rank)
    fastest = min(x.step_ms for x in preds)
    _, bounded = plan(p, cands, tpot_ms=fastest)
    assert bounded is not None and bounded.step_ms == fastest
    assert plan(p, cands, tpot_ms=fastest / 2)[1] is None


def test_profile_round_trips_and_names_bad_keys(tmp_path):
    p = _profile()
    path = tmp_path / "p.json"
    p.save(path)
    assert Profile.load(path) == p
    raw = json.loads(path.read_text())
    with pytest.raises(AFDConfigError, match="dispatch='broadcast'; expected one of fan_in, routed"):
        Profile.from_dict({**raw, "dispatch": "broadcast"})
    with pytest.raises(AFDConfigError, match="no 'ffn_us'") as exc:
        Profile.from_dict({k: v for k, v in raw.items() if k != "ffn_us"})
    assert exc.value.key == "ffn_us"
    with pytest.raises(AFDConfigError, match="version"):
        Profile.from_dict({**raw, "version": 99})


def test_stepmesh_budget_is_reproduced():
    rows = {r["figure"]: r for r in reproduce()}
    for row in rows.values():
        assert row["planner"] == pytest.approx(row["published"], rel=0.02)
    # 256 rows reach each FFN GPU (2 ranks x 128, nearly every token needs both halves of 256 experts, top-8)
    spec = HardwareSpec.from_dict(STEPMESH_SPEC)
    assert exchange_budget(spec, attention=2, ffn=2, batch=128)["rows_per_ffn"] == pytest.approx(255.0, abs=1.0)


def test_hardware_spec_names_the_missing_key():
    raw = json.loads(json.dumps(STEPMESH_SPEC))
    del raw["link"]["gbits_per_s"]
    with pytest.raises(AFDConfigError, match="link.gbits_per_s") as exc:
        HardwareSpec.from_dict(raw)
    assert exc.value.key == "link.gbits_per_s"


def test_hardware_spec_rooflines():
    raw = json.loads(json.dumps(STEPMESH_SPEC))
    expert_flops, expert_bytes = 6 * 7168 * 2048, 3 * 7168 * 2048
    raw["model"].update(expert_flops_per_token=expert_flops, expert_weight_bytes=expert_bytes)
    raw["ffn"] = {"tflops": 1000, "memory_gbytes_per_s": 3000}
    spec = HardwareSpec.from_dict(raw)
    pred = predict(spec, Deployment(2, 2, 1, 128))
    # each FFN device: 2 x 128 tokens x top-8 / 2 devices = 1024 expert assignments over its 128 experts
    hit = 128 * (1 - (1 - 1 / 128) ** 1024)
    expected = max(expert_flops * 1024 / 1e15, expert_bytes * hit / 3e12) * 1e6
    assert pred.ffn_us == pytest.approx(expected)
    assert expected == pytest.approx(expert_bytes * hit / 3e12 * 1e6)  # memory-bound at this batch
    a2f, f2a = spec.exchange_us(2, 2, 128)
    assert pred.exchange_us == pytest.approx(a2f + f2a)
    assert pred.attention_us == 0.0  # no attention figures given: not modelled
    assert pred.step_ms == pytest.approx(61 * (expected + a2f + f2a) / 1000)


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("model", "top_k"), 300, "model.top_k=300 with model.num_experts=256"),
        (("model", "hidden_size"), 7168.5, "model.hidden_size=7168.5; expected a whole number"),
        (("link", "gbits_per_s"), 0, "link.gbits_per_s=0; expected a number > 0"),
        (("link", "gbits_per_s"), "fast", "link.gbits_per_s='fast'; expected a number"),
    ],
)
def test_hardware_spec_names_the_bad_value(path, value, match):
    raw = json.loads(json.dumps(STEPMESH_SPEC))
    raw[path[0]][path[1]] = value
    with pytest.raises(AFDConfigError, match=match):
        HardwareSpec.from_dict(raw)


def test_host_and_routed_placement_are_checked():
    with pytest.raises(AFDConfigError, match="host.threads_per_process=0") as exc:
        _profile(host=Host(cores=2, threads_per_process=0))
    assert exc.value.key == "host.threads_per_process"
    with pytest.raises(AFDConfigError, match="host.concurrency_slowdown=0.5"):
        _profile(host=Host(cores=2, concurrency_slowdown=0.5))
    raw = _profile().as_dict()
    with pytest.raises(AFDConfigError, match="wrong type"):
        Profile.from_dict({**raw, "hidden_size": "wide"})
    routed = _profile(dispatch="routed")
    with pytest.raises(AFDConfigError, match="divide the experts"):
        predict(routed, Deployment(3, 3, 1, 4))
    from afd_sdk.plan.model import deployments

    kept = deployments([3], [1, 2, 3, 4], [1], [4], "routed", num_experts=8)
    assert [d.ffn for d in kept] == [1, 2, 4]


def test_cli_plan_json_and_errors(tmp_path, capsys):
    path = tmp_path / "p.json"
    _profile().save(path)
    rc = main(["plan", "--profile", str(path), "--attention", "1-2", "--ffn", "1", "--stages", "1,2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["predictions"]) == 4 and out["best"]["label"] in {p["label"] for p in out["predictions"]}
    assert main(["plan", "--attention", "1"]) == 2
    assert "give one of --profile" in capsys.readouterr().err
    assert main(["plan", "--profile", str(path), "--attention", "x-2"]) == 2
    assert "--attention 'x-2'" in capsys.readouterr().err
    assert main(["plan", "--profile", str(path), "--attention", "3-1"]) == 2
    assert "a rising range" in capsys.readouterr().err
    assert main(["plan", "paper", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3


def test_cli_plans_from_a_hardware_spec(tmp_path, capsys):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(STEPMESH_SPEC))
    args = ["plan", "--hardware", str(path), "--attention", "2", "--ffn", "2", "--stages", "1", "--batch", "128"]
    assert main([*args, "--json"]) == 0
    (pred,) = json.loads(capsys.readouterr().out)["predictions"]
    # nothing but the link is given: 61 layers of the 272 µs exchange
    assert pred["step_ms"] == pytest.approx(61 * 272.08 / 1000, rel=1e-3)
    assert pred["bottleneck"] == "exchange"
    path.write_text("{not json")
    assert main(["plan", "--hardware", str(path)]) == 2
    assert "hardware=" in capsys.readouterr().err


def test_cli_plot_and_table_name_the_best(tmp_path, capsys):
    path = tmp_path / "p.json"
    _profile().save(path)
    png = tmp_path / "plan.png"
    rc = main(
        ["plan", "--profile", str(path), "--attention", "1-3", "--ffn", "1", "--stages", "1,2", "--plot", str(png)]
    )
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    _, best = plan(_profile(), [Deployment(a, 1, s, 4) for a in (1, 2, 3) for s in (1, 2)])
    assert f"best: {best.deployment.label}" in out
    assert main(["plan", "--profile", str(path), "--tpot-ms", "0.001"]) == 0
    assert "no configuration meets --tpot-ms" in capsys.readouterr().err


def test_calibrate_refuses_what_it_cannot_measure(tmp_path, capsys):
    out = str(tmp_path / "p.json")
    assert main(["plan", "calibrate", "--engine", "native", "--out", out]) == 2
    assert "--engine 'native'; expected one of reference, vllm" in capsys.readouterr().err
    if importlib.util.find_spec("vllm") is None:  # .venv: the vLLM tier calibrates with it
        assert main(["plan", "calibrate", "--engine", "vllm", "--out", out]) == 2
        assert "a vLLM-engine plan needs vLLM in this environment" in capsys.readouterr().err
    assert main(["plan", "calibrate", "--engine", "vllm", "--connector", "cam", "--out", out]) == 2
    assert "the gate-on-Attention roles are calibrated on the reference runtime only" in capsys.readouterr().err


def test_validate_of_a_vllm_profile_is_one_stage_in_the_vllm_environment(tmp_path, capsys):
    path = tmp_path / "vllm.json"
    _profile(engine="vllm").save(path)
    assert Profile.load(path).engine == "vllm"
    # refused before any world starts: AFD inside vLLM runs no micro-batch overlap
    assert main(["plan", "validate", "--profile", str(path), "--stages", "1,2", "--batch", "2"]) == 2
    assert "stages=2 (1A1F 2S b2) with a vLLM-engine profile; expected 1" in capsys.readouterr().err
    if importlib.util.find_spec("vllm") is None:  # .venv: the vLLM tier validates with it
        assert main(["plan", "validate", "--profile", str(path), "--batch", "2"]) == 2
        assert "run .venv-vllm/bin/afd plan validate" in capsys.readouterr().err
    with pytest.raises(AFDConfigError, match="engine='gpu'; expected one of reference, vllm"):
        _profile(engine="gpu")


def _decode(**over) -> DecodeCosts:
    # attention per layer: 100 µs + 1 µs per request at context 100, 300 µs + 3 µs per request at context 300
    kw = dict(
        attention_us={
            100: Curve(((1.0, 101.0), (8.0, 108.0))),
            300: Curve(((1.0, 303.0), (8.0, 324.0))),
        },
        ffn_us=Curve(((1.0, 50.0), (8.0, 400.0))),
        step_overhead_us=240.0,
    )
    kw.update(over)
    return DecodeCosts(**kw)


def test_decode_attention_interpolates_over_context():
    d = _decode()
    assert d.contexts == [100, 300]
    assert d.attention_at(200).points == ((1.0, 202.0), (8.0, 216.0))  # halfway at every token count
    assert d.attention_at(500).points == ((1.0, 505.0), (8.0, 540.0))  # the last segment's slope beyond
    assert d.attention_at(300)(4.0) == pytest.approx(312.0)
    with pytest.raises(AFDConfigError, match="same points"):
        _decode(attention_us={100: Curve(((1.0, 1.0),)), 300: Curve(((2.0, 1.0),))})
    with pytest.raises(AFDConfigError, match="at least one context"):
        _decode(attention_us={})


def test_a_decode_step_is_one_token_per_request_over_the_context():
    p = _profile(tokens_per_request=16, decode=_decode())
    q = p.at_context(200)
    assert q.tokens_per_request == 1 and q.decode is None
    assert q.step_overhead_us == 240.0 and q.attention_us == p.decode.attention_at(200)
    pred = predict(q, Deployment(1, 1, 1, 4))
    # per layer: attention at context 200 for 4 tokens (208), the decode FFN curve (200), 4 KiB round trip (4);
    # then the decode step's overhead
    assert pred.step_ms == pytest.approx((4 * (208 + 200 + 4) + 240) / 1000)
    assert pred.attention_us == pytest.approx(208.0) and pred.ffn_us == pytest.approx(200.0)
    with pytest.raises(AFDConfigError, match=r"context=64: this profile has no decode curves") as exc:
        _profile().at_context(64)
    assert exc.value.key == "context"


def test_decode_costs_round_trip_and_older_profiles_still_load(tmp_path):
    p = _profile(decode=_decode())
    path = tmp_path / "p.json"
    p.save(path)
    assert Profile.load(path) == p
    raw = json.loads(path.read_text())
    assert sorted(raw["decode"]["attention_us"]) == ["100", "300"]
    # a profile written before decode calibration loads as before
    old = {k: v for k, v in raw.items() if k != "decode"}
    assert Profile.from_dict(old) == _profile()
    with pytest.raises(AFDConfigError, match="'decode.ffn_us'"):
        Profile.from_dict({**raw, "decode": {k: v for k, v in raw["decode"].items() if k != "ffn_us"}})
    with pytest.raises(AFDConfigError, match="decode.attention_us"):
        Profile.from_dict({**raw, "decode": {**raw["decode"], "attention_us": {"x": [[1, 2]]}}})


def test_cli_plans_decode_at_a_context(tmp_path, capsys):
    path = tmp_path / "p.json"
    _profile(tokens_per_request=16, decode=_decode()).save(path)
    args = ["plan", "--profile", str(path), "--attention", "1", "--ffn", "1", "--stages", "1", "--batch", "4"]
    assert main([*args, "--context", "200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["context"] == 200
    assert out["predictions"][0]["step_ms"] == pytest.approx((4 * (208 + 200 + 4) + 240) / 1000)
    assert main([*args, "--context", "200"]) == 0
    assert "decode over 200 tokens of context" in capsys.readouterr().out
    _profile().save(path)
    assert main([*args, "--context", "200"]) == 2
    assert "afd plan calibrate --context" in capsys.readouterr().err
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(STEPMESH_SPEC))
    assert HardwareSpec.load(spec).at_context(4096).compute["context_tokens"] == 4096.0
    assert (
        main(
            [
                "plan",
                "--hardware",
                str(spec),
                "--attention",
                "2",
                "--ffn",
                "2",
                "--stages",
                "1",
                "--batch",
                "128",
                "--context",
                "4096",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["context"] == 4096


def test_calibrate_refuses_contexts_the_bench_model_cannot_hold(tmp_path, capsys):
    out = str(tmp_path / "p.json")
    assert main(["plan", "calibrate", "--context", "64,4090", "--out", out]) == 2
    assert "context=[64, 4090]; expected KV-cache lengths in 1..4085" in capsys.readouterr().err
    assert main(["plan", "calibrate", "--context", "64-512", "--out", out]) == 2
    assert "--context '64-512'; expected a list of KV-cache lengths" in capsys.readouterr().err


def test_calibration_fits_the_step_overhead_to_the_less_disturbed_world():
    """Step 4 of calibration against scripted worlds: every 1A1F world costs the model plus 2 ms, but every run
    of the b4 world also suffers a 15 ms slow spell. The overhead is the smaller excess (b1's), each world's
    fastest run counts, and the 2A2F world fits the concurrency slowdown."""
    from types import SimpleNamespace

    from afd_sdk.plan.calibrate import _fit_to_worlds

    p = _profile(step_overhead_us=0.0, host=Host(cores=2))
    truth = replace(p, step_overhead_us=2000.0, host=Host(cores=2, concurrency_slowdown=1.5))
    runs: list[tuple[str, int | None]] = []

    def measure(dep, *, context, **_kw):
        runs.append((dep.label, context))
        slow = 15.0 if dep == Deployment(1, 1, 1, 4) else 0.0
        again = 5.0 * sum(r == (dep.label, context) for r in runs[:-1])  # a later round is slower still
        return {"step_ms": predict(truth, dep).step_ms + slow + again}

    fitted = _fit_to_worlds(
        p, measure, "unused", SimpleNamespace(vocab_size=8), [1, 2, 4, 8], [], {}, None, 2, lambda *_: None
    )
    # both rounds in turns: b1, b4, 2A2F b4, then again
    assert runs == [("1A1F 1S b1", None), ("1A1F 1S b4", None), ("2A2F 1S b4", None)] * 2
    assert fitted.step_overhead_us == pytest.approx(2000.0)
    assert fitted.measured["overhead_step"]["deployment"] == "1A1F 1S b1"
    assert fitted.measured["overhead_step_b4"]["measured_ms"] == pytest.approx(
        predict(truth, Deployment(1, 1, 1, 4)).step_ms + 15.0
    )
    assert fitted.host.concurrency_slowdown == pytest.approx(1.5, rel=1e-3)


def test_validate_measures_the_host_drift_on_calibrations_worlds(monkeypatch, tmp_path, capsys):
    """``afd plan validate`` against scripted worlds: the host now runs every world 1.5 times as slow as at
    calibration, except the b4 world, whose runs all suffer a slow spell, and the model is otherwise exact.
    Calibration's 1A1F worlds of the kind validated run in each round (b4 is a validated row: its runs serve); the
    drift is their geometric mean, and scaled by it the errors shrink. Decode validation runs the decode worlds at
    their context; a profile without real worlds validates without them."""
    from types import SimpleNamespace

    import afd_sdk.bench.pipeline_bench as pipeline_bench
    import afd_sdk.plan.validate as validate_module
    from afd_sdk.plan.calibrate import fitted_worlds

    base = _profile(decode=_decode())
    b1, b4 = Deployment(1, 1, 1, 1), Deployment(1, 1, 1, 4)
    measured = {
        "overhead_step": {"deployment": b1.label, "measured_ms": predict(base, b1).step_ms, "modelled_ms": 0.0},
        **{
            f"overhead_step_b{d.batch}": {"deployment": d.label, "measured_ms": predict(base, d).step_ms}
            for d in (b1, b4)
        },
        **{
            f"decode_overhead_step_b{d.batch}": {
                "deployment": d.label,
                "context": 100,
                "measured_ms": predict(base.at_context(100), d).step_ms,
            }
            for d in (b1, b4)
        },
    }
    runs: list[tuple[str, int | None, int]] = []

    def measure(dep, *, context, repeat, **_kw):
        runs.append((dep.label, context, repeat))
        later = 10.0 * sum(r[:2] == (dep.label, context) for r in runs[:-1])  # the fastest run counts
        spell = 1.2 if (dep, context) == (b4, None) else 1.0
        step = predict(base if context is None else base.at_context(context), dep).step_ms
        return {"step_ms": 1.5 * spell * step + later}

    monkeypatch.setattr(validate_module, "measure_step", measure)
    config = SimpleNamespace(vocab_size=8, max_position_embeddings=4096)
    monkeypatch.setattr(pipeline_bench, "bench_config", lambda *_: config)
    monkeypatch.setattr(pipeline_bench, "save_bench_checkpoint", lambda *_: None)
    deps = [b4, Deployment(2, 1, 1, 8)]
    profile = replace(base, measured=measured)
    r = validate_module.validate(profile, deps, rounds=2, repeat=5)
    assert runs == [("1A1F 1S b1", None, 5), ("1A1F 1S b4", None, 5), ("2A1F 1S b8", None, 5)] * 2
    drift = r["host_drift"]
    assert [(w["deployment"], w["context"], len(w["measured_runs_ms"])) for w in drift["worlds"]] == [
        ("1A1F 1S b1", None, 2),
        ("1A1F 1S b4", None, 2),
    ]
    assert [w["ratio"] for w in drift["worlds"]] == pytest.approx([1.5, 1.8])
    assert drift["ratio"] == pytest.approx(1.5 * 1.2**0.5)
    assert [row["error"] for row in r["rows"]] == pytest.approx([1 / 1.8 - 1, -1 / 3])
    corrected = [1.5 * 1.2**0.5 / 1.8 - 1, 1.2**0.5 - 1]
    assert [row["drift_corrected_error"] for row in r["rows"]] == pytest.approx(corrected)
    assert r["drift_corrected_worst_abs_error"] == pytest.approx(max(map(abs, corrected)))
    profile.save(tmp_path / "profile.json")
    argv = ["plan", "validate", "--profile", str(tmp_path / "profile.json"), "--ffn", "1", "--stages", "1"]
    runs.clear()
    assert main([*argv, "--attention", "1-2", "--batch", "4,8", "--repeat", "5"]) == 0
    out = capsys.readouterr().out
    assert out.count("+9.5%") == 3 and out.count("-8.7%") == 1, out  # the drift-corrected errors: b4, the rest
    assert "host drift since calibration x1.64 (1A1F 1S b1 " in out and "; the predictions scaled by it:" in out, out
    runs.clear()
    r = validate_module.validate(profile, deps, repeat=5, context=200)
    assert runs == [("1A1F 1S b1", 100, 5), ("1A1F 1S b4", 100, 5), ("1A1F 1S b4", 200, 5), ("2A1F 1S b8", 200, 5)]
    assert r["host_drift"]["ratio"] == pytest.approx(1.5)
    assert r["drift_corrected_worst_abs_error"] == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(AFDConfigError, match="repeat=4090: calibration's decode world 1A1F 1S b1 at context 100"):
        validate_module.validate(profile, deps, repeat=4090, context=1)
    # a profile from before the per-batch worlds: its one fitted world
    old = replace(base, measured={"overhead_step": measured["overhead_step"]})
    assert fitted_worlds(old, decode=False) == [(b1, None, measured["overhead_step"]["measured_ms"])]
    assert fitted_worlds(old, decode=True) == []
    runs.clear()
    r = validate_module.validate(base, deps)
    assert runs == [("1A1F 1S b4", None, 10), ("2A1F 1S b8", None, 10)] and r["host_drift"] is None
    assert r["drift_corrected_worst_abs_error"] is None and r["rows"][0]["drift_corrected_error"] is None


def test_a_deployment_label_reads_back():
    assert Deployment.from_label("3A2F 2S b16") == Deployment(3, 2, 2, 16)
    with pytest.raises(AFDConfigError, match="deployment='3A2F b16'; expected a label like '2A1F 1S b8'"):
        Deployment.from_label("3A2F b16")


def test_calibrations_overhead_worlds_read_in_batch_order():
    """``overhead_worlds`` serves validate's anchors and the calibrate command's line alike: batch order (b10 after
    b2, not the keys' text order), prefill and decode apart, the fitted ``overhead_step`` record not among them."""
    from afd_sdk.cli.plan import _worlds
    from afd_sdk.plan.calibrate import fitted_worlds, overhead_worlds

    def world(batch: int, context: int | None = None) -> dict:
        return {"deployment": f"1A1F 1S b{batch}", "context": context, "measured_ms": 2.0 * batch, "modelled_ms": 1.0}

    measured = {
        "overhead_step": world(2),
        "overhead_step_b10": world(10),
        "overhead_step_b2": world(2),
        "decode_overhead_step_b10": world(10, 64),
        "decode_overhead_step_b2": world(2, 64),
        "concurrency_step": {"deployment": "2A2F 1S b4", "measured_ms": 9.0},
    }
    assert [w["deployment"] for w in overhead_worlds(measured, decode=False)] == ["1A1F 1S b2", "1A1F 1S b10"]
    assert [w["context"] for w in overhead_worlds(measured, decode=True)] == [64, 64]
    assert _worlds(measured, decode=False) == "1A1F 1S b2 4.0 vs 1.0 ms, 1A1F 1S b10 20.0 vs 1.0 ms"
    profile = replace(_profile(), measured=measured)
    assert fitted_worlds(profile, decode=True) == [
        (Deployment(1, 1, 1, 2), 64, 4.0),
        (Deployment(1, 1, 1, 10), 64, 20.0),
    ]


def test_validate_progress_says_the_time_left(monkeypatch, capsys):
    """``afd plan validate`` announces each run as it starts, with the time left at the pace of the runs finished so
    far (a three-round sweep takes 10 to 15 minutes here)."""
    import afd_sdk.cli.plan as cli_plan

    real = cli_plan.time.monotonic
    ticks = [100.0, 100.0, 130.0, 190.0]  # the start, then as each of three runs starts
    monkeypatch.setattr(cli_plan.time, "monotonic", lambda: ticks.pop(0) if ticks else real())
    show = cli_plan._stderr_progress("validate", eta=True)
    for i, label in enumerate(("1A1F 1S b8", "2A1F 1S b8", "3A1F 1S b8")):
        show(label, i + 1, 4)
    assert capsys.readouterr().err.splitlines() == [
        "validate [1/4] 1A1F 1S b8 (0s)",
        "validate [2/4] 2A1F 1S b8 (30s, about 90s left)",
        "validate [3/4] 3A1F 1S b8 (90s, about 90s left)",
    ]
