"""CAM with redundant experts (``expert_replicas`` 2): the attention ranks route around a lost FFN rank.

Real processes through the async-dispatch kit's workers: an FFN rank dies holding a work item, or freezes while
the world idles; the attention ranks re-dispatch what it had to the other holder of its experts (``REDO`` items)
and every combined output still equals the local computation exactly. Losing every holder of an expert is the old
``PeerLostError``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from scrape import metric_sum as _metric

from afd_sdk.runtime.world import free_port_block
from afd_sdk.testing import AsyncDispatchConformance
from afd_sdk.topology import build_world

pytestmark = pytest.mark.multiprocess

LAYERS = (1, 2, 3)
AFD = [sys.executable, "-m", "afd_sdk.cli"]


class _Redundant(AsyncDispatchConformance):
    connector = "CAMAsyncAFDConnector"
    extra_config = {"backend": "portable", "expert_replicas": 2}


@pytest.fixture
def kit() -> _Redundant:
    return _Redundant()


def _attention_exact(world, spec) -> None:
    exchanges = spec["steps"] * len(spec["moe"]["layers"]) * spec["afd"]["num_stages"]
    for r in world.by_role("attention"):
        assert r.ok, world.describe()
        assert r.result["checks"] == exchanges and r.result["max_abs_diff"] == 0.0, world.describe()


def test_routing_goes_to_the_next_live_holder_and_fails_when_none_is_left():
    w = build_world("attention_first", 1, 4, num_experts=8, expert_replicas=2)
    assert [list(w.local_experts(f)) for f in range(4)] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2
    assert w.routing() == (0, 0, 1, 1, 2, 2, 3, 3)
    assert w.routing({1}) == (0, 0, 0, 0, 2, 2, 3, 3)
    assert w.routing({0, 3}) == (1, 1, 1, 1, 2, 2, 2, 2)
    assert w.routing({2, 3})[4:] == (None,) * 4
    with pytest.raises(Exception, match="expert_replicas=3 does not divide num_ffn_ranks=4"):
        build_world("attention_first", 1, 4, num_experts=8, expert_replicas=3)


def test_redundant_placement_is_exact_without_faults(kit):
    spec = kit.make_spec(attention=2, ffn=2, layers=LAYERS)
    kit.assert_exact(kit.run(spec), spec)


@pytest.mark.parametrize("item", [2, 3])  # layer 3 of step 0, and layer 1 of step 1 (the step's first)
def test_ffn_rank_killed_holding_an_item_is_routed_around(kit, item):
    stages = 1  # expert_replicas > 1 needs one stage (test_cam_connector's config case)
    spec = kit.make_spec(attention=2, ffn=2, layers=LAYERS, stages=stages, timeout_s=5.0)
    world = kit.run(spec, per_rank={("ffn", 1): {"die_after_items": item}})
    _attention_exact(world, spec)
    dead, survivor = world.by_role("ffn")[1], world.by_role("ffn")[0]
    assert dead.returncode == 3, world.describe()
    assert survivor.ok, world.describe()
    items = survivor.result["items"]
    # every exchange once, plus the re-dispatched rows of the lost rank as items right after their layer
    assert len(items) > spec["steps"] * len(LAYERS) * stages, world.describe()
    for stage in range(stages):
        mine = [(layer, peers) for layer, s, _n, peers in items if s == stage]
        firsts = [layer for i, (layer, _) in enumerate(mine) if i == 0 or mine[i - 1][0] != layer]
        assert firsts == list(LAYERS) * spec["steps"], world.describe()
        assert len(mine) > len(firsts), world.describe()


def test_ffn_rank_frozen_while_idle_is_routed_around_and_stops_when_it_resumes(kit):
    spec = kit.make_spec(attention=1, ffn=2, layers=LAYERS, timeout_s=2.0, steps=3)
    # before steps 1 and 2 the attention rank idles 3 s: FFN rank 1 freezes after step 0 and misses 3 beats (1 s)
    # in the first pause, so step 1 goes to FFN rank 0 alone; it resumes in the second pause, reads its fence and
    # stops while the world still runs
    spec["pause_s"] = 3.0
    world = kit.run(spec, per_rank={("ffn", 1): {"freeze_after_items": len(LAYERS), "freeze_s": 4.0}})
    _attention_exact(world, spec)
    frozen = world.by_role("ffn")[1]
    assert frozen.result.get("error_type") == "PeerLostError", world.describe()
    assert "routed around this FFN rank" in frozen.result["error_message"], world.describe()
    assert world.by_role("ffn")[0].ok, world.describe()


def test_ffn_rank_frozen_mid_step_is_given_up_and_routed_around(kit):
    # FFN rank 1 freezes before its third item (step 0, layer 3): the attention ranks wait for it on a watched
    # thread, give its part up after 3 missed beats (1 s) and re-dispatch it; no Gloo wait ever times out
    spec = kit.make_spec(attention=2, ffn=2, layers=LAYERS, timeout_s=2.0)
    world = kit.run(spec, per_rank={("ffn", 1): {"freeze_after_items": 2, "freeze_s": 5.0}})
    _attention_exact(world, spec)
    assert world.by_role("ffn")[0].ok, world.describe()
    assert world.by_role("ffn")[1].result.get("error_type") == "PeerLostError", world.describe()
    for r in world.by_role("attention"):
        assert "no heartbeat through" in r.stderr, world.describe()


def test_every_holder_lost_is_peer_lost(kit):
    spec = kit.make_spec(attention=1, ffn=2, layers=LAYERS, timeout_s=5.0)
    world = kit.run(spec, per_rank={("ffn", 0): {"die_after_items": 2}, ("ffn", 1): {"die_after_items": 2}})
    (attn,) = world.by_role("attention")
    assert attn.result.get("error_type") == "PeerLostError", world.describe()
    assert "no live holder left" in attn.result["error_message"], world.describe()


# --- the reference runtime: afd attention generate against two FFN ranks holding every expert twice --------------


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    pytest.importorskip("transformers", reason="the runtime needs the [hf] extra")
    from afd_sdk.integrations.transformers import save_tiny_checkpoint

    return str(save_tiny_checkpoint("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("qwen")))


def _steps(port: int) -> float:
    """``afd_steps_total`` of the attention rank's endpoint (0 before it listens)."""
    return _metric(port, "afd_steps_total")


class Generation:
    """``afd ffn serve --rank 0/1`` (expert_replicas 2, FFN rank 1 with an ops endpoint) and ``afd attention
    generate --reference --json`` of ``tokens`` (160) against them, on ``attention`` ranks (each the same prompt:
    routed dispatch steps every attention rank together; rank ``r``'s log is ``gen`` for 0, ``gen<r>`` after)."""

    def __init__(self, model: str, tmp, tokens: int = 160, attention: int = 1) -> None:
        self.tmp = tmp
        self.TOKENS = tokens
        self.cfg = {
            "connector": "CAMAsyncAFDConnector",
            "compute_gate_on_attention": True,
            "host": "127.0.0.1",
            "port": free_port_block(8),
            "timeout_s": 5,
            "num_attention_ranks": attention,
            "num_ffn_ranks": 2,
            "connector_extra_config": {"expert_replicas": 2},
        }
        self.metrics, self.ffn_ops = free_port_block(attention), free_port_block(1)
        gens = ["gen", *(f"gen{r}" for r in range(1, attention))]
        self.logs = {name: open(tmp / f"{name}.err", "w") for name in ("ffn0", "ffn1", "ffn1b", *gens)}
        self.serve = serve = ("ffn", "serve", "--model", model, "--rank")
        self.ffn = [
            self._spawn("ffn0", *serve, "0"),
            self._spawn("ffn1", *serve, "1", "--metrics-port", str(self.ffn_ops)),
        ]
        generate = ("attention", "generate", "--model", model, "--prompt-ids", "5,6,7", "--max-new-tokens",
                    str(self.TOKENS), "--reference", "--json")  # fmt: skip
        self.gens = [
            self._spawn(
                name, *generate, "--rank", str(r), "--metrics-port", str(self.metrics + r), stdout=subprocess.PIPE
            )
            for r, name in enumerate(gens)
        ]
        self.gen = self.gens[0]

    def _spawn(self, name: str, *argv: str, stdout: int = subprocess.DEVNULL) -> subprocess.Popen[str]:
        argv = (*argv, "--config", json.dumps(self.cfg))
        return subprocess.Popen([*AFD, *argv], stdout=stdout, stderr=self.logs[name], text=True)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.err").read_text()

    def after_steps(self, n: int) -> None:
        deadline = time.monotonic() + 120
        while _steps(self.metrics) < n:
            assert time.monotonic() < deadline and self.gen.poll() is None, self.log("gen")[-3000:]
            time.sleep(0.01)

    def until_logged(self, name: str, text: str) -> None:
        """Wait (at most 120 s) until ``name``'s log says ``text``, while the generation runs."""
        deadline = time.monotonic() + 120
        while text not in self.log(name):
            assert time.monotonic() < deadline and self.gen.poll() is None, self.log("gen")[-3000:]
            time.sleep(0.05)

    def finish(self) -> dict:
        """Attention rank 0's result, after checking that every attention rank exited 0 with the reference's tokens
        and logits."""
        results = []
        for r, gen in enumerate(self.gens):
            name = "gen" if r == 0 else f"gen{r}"
            out, _ = gen.communicate(timeout=240)
            assert gen.returncode == 0, self.log(name)[-3000:]
            result = json.loads(out)
            assert result["tokens_equal"] and len(result["tokens"][0]) == self.TOKENS, result
            assert result["max_abs_diff"] <= 1e-5, result["max_abs_diff"]
            results.append(result)
        return results[0]

    def close(self) -> None:
        for p in (*self.ffn, *self.gens):
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait(30)
        for f in self.logs.values():
            f.close()


@pytest.fixture
def generation(qwen_dir, tmp_path):
    run = Generation(qwen_dir, tmp_path)
    try:
        yield run
    finally:
        run.close()


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_generate_goes_on_when_an_ffn_rank_is_killed_or_frozen(generation, fault):
    """kill -9 (its connection closes) or SIGSTOP (its heartbeats stop) of FFN rank 1 mid-run: the attention rank
    re-dispatches its rows to FFN rank 0 and finishes with the reference's tokens and logits."""
    run = generation
    run.after_steps(40)  # well into the run
    run.ffn[1].send_signal(getattr(signal, fault))
    result = run.finish()
    log = run.log("gen")
    assert "ffn rank 1 lost" in log, log[-3000:]
    print(f"{fault}: max |logit - reference| after the failover: {result['max_abs_diff']:g}")
    print(*(line for line in log.splitlines() if "re-dispatched" in line or "lost (" in line), sep="\n")
    assert run.ffn[0].wait(30) == 0, run.log("ffn0")[-3000:]


def test_a_drained_ffn_rank_exits_0_and_generation_goes_on(generation):
    """POST /drain on FFN rank 1 mid-run: the attention rank routes its experts to FFN rank 0 at its next dispatch,
    says goodbye once nothing is in flight there, and FFN rank 1 exits 0; the tokens and logits are the
    reference's."""
    run = generation
    run.after_steps(40)
    code, body = _post(f"http://127.0.0.1:{run.ffn_ops}/drain?op=move-1")
    assert code == 202 and body == {"op": "move-1", "state": "draining"}, body
    assert run.ffn[1].wait(60) == 0, run.log("ffn1")[-3000:]
    assert "drained (move-1)" in run.log("ffn1"), run.log("ffn1")[-3000:]
    run.finish()
    log = run.log("gen")
    assert "ffn rank 1 is draining" in log and "lost (" not in log, log[-3000:]
    assert _post(f"http://127.0.0.1:{run.ffn_ops}/drain?op=move-1")[0] is None  # it is gone
    assert run.ffn[0].wait(30) == 0, run.log("ffn0")[-3000:]


def _post(url: str) -> tuple[int | None, dict]:
    """POST ``url``: (status, JSON body); ``(None, {})`` when nothing listens."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return None, {}


@pytest.fixture(scope="module")
def long_qwen_dir(tmp_path_factory):
    """The tiny Qwen3-MoE with room for a generation long enough to restart a process in."""
    pytest.importorskip("transformers", reason="the runtime needs the [hf] extra")
    from afd_sdk.integrations.transformers import save_tiny_checkpoint

    return str(
        save_tiny_checkpoint(
            "Qwen3MoeForCausalLM", tmp_path_factory.mktemp("qwen-long"), overrides={"max_position_embeddings": 4096}
        )
    )


# CI: two attention ranks (they must agree on the step) and the new process started as a standby while FFN rank 1
# still runs (a cold start races no generation); -m slow: one attention rank and the process started after the kill
# (under vllm serve, tests/vllm_tier/test_vllm_failover.py restarts after the kill in CI), and after a drain (the
# drained incarnation's keys are forgotten at the readmit just as a lost one's)
@pytest.mark.parametrize(
    ("attention", "start"),
    [
        pytest.param(1, "restarted", marks=pytest.mark.slow),
        (2, "standby"),
        pytest.param(1, "drained", marks=pytest.mark.slow),
    ],
)
def test_a_new_ffn_process_rejoins_for_a_killed_rank_and_serves_alone(long_qwen_dir, tmp_path, attention, start):
    """kill -9 of FFN rank 1 mid-run (or a drain: it exits 0) and ``afd ffn serve --rank 1`` started again (before
    the kill, as a standby, or after it): the new process rejoins the running world (its own groups with each
    attention rank, admitted at a step they agreed on) and takes its experts back; then FFN rank 0 is killed too and
    the new process serves every expert to the end. No attention rank restarts; every rank's tokens and logits are
    the reference's and the new process exits 0."""
    # long enough that the rejoin comes well before the end: the standby, started before the kill, rejoined at
    # step 186 of 450 here; a process started after the kill or the drain needs its cold start too
    run = Generation(long_qwen_dir, tmp_path, tokens=450 if start == "standby" else 700, attention=attention)
    try:
        run.after_steps(20)
        if start == "standby":
            run.ffn.append(run._spawn("ffn1b", *run.serve, "1"))
            run.until_logged("ffn1b", "joins a running world as incarnation 1")
            assert "rejoined" not in run.log("gen")  # FFN rank 1 is still served: the new process waits
            run.ffn[1].kill()
        elif start == "drained":
            code, body = _post(f"http://127.0.0.1:{run.ffn_ops}/drain?op=retire-1")
            assert code == 202, body
            assert run.ffn[1].wait(60) == 0, run.log("ffn1")[-3000:]
            assert "ffn rank 1 is draining" in run.log("gen"), run.log("gen")[-3000:]
            run.ffn.append(run._spawn("ffn1b", *run.serve, "1"))
        else:
            run.ffn[1].kill()
            run.until_logged("gen", "ffn rank 1 lost")
            run.ffn.append(run._spawn("ffn1b", *run.serve, "1"))
        run.until_logged("gen", "ffn rank 1 rejoined (incarnation 1)")
        assert _metric(run.metrics, "afd_ffn_rejoins_total") == 1
        steps = _steps(run.metrics)
        assert steps < run.TOKENS - 50, f"the generation was nearly over ({steps} steps) before the rejoin"
        run.after_steps(steps + 10)  # steps served by the rejoined rank beside FFN rank 0
        run.ffn[0].kill()
        run.finish()
        log = run.log("gen")
        assert "ffn rank 0 lost" in log, log[-3000:]
        at_step = log.split("rejoined")[1].split(";")[0] + ";"  # " (incarnation 1) at step N;"
        for r in range(1, attention):  # every rank routed to it again at the same step
            assert at_step in run.log(f"gen{r}"), run.log(f"gen{r}")[-3000:]
        assert run.ffn[2].wait(30) == 0, run.log("ffn1b")[-3000:]
        print(*(line for line in log.splitlines() if "rejoin" in line or "lost (" in line), sep="\n")
    finally:
        run.close()
