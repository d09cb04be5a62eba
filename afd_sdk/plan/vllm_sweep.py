"""Measured split steps inside vLLM: one AFD world of vLLM engines per configuration, for ``afd plan validate``
of a profile calibrated with ``--engine vllm``.

Worker module of :func:`measure_vllm_step` (``python -m afd_sdk.plan.vllm_sweep SPEC_JSON``). FFN ranks are
vLLM's FFN role as ``afd ffn serve --engine vllm`` builds it, serving until goodbye. Every attention rank is an
in-process ``vllm.LLM`` with the AFD Attention role (``additional_config={"afd": ...}``, its rank
``server_rank``), built with the calibration's engine arguments
(:func:`~afd_sdk.plan.vllm_curves.plan_engine_kwargs`), and times what the planner predicts:

* prefill-shaped steps: ``generate`` calls of ``batch`` prompts of ``tokens_per_request`` tokens and one output
  token each, one engine step per call; a step is the call's wall time;
* decode steps (with a ``context``): one ``generate`` call over prompts of ``context`` tokens; a step is the time
  from one decode forward's start to the next one's (the engine's own step, its scheduling and sampling
  included), its prefill and :data:`~afd_sdk.plan.sweep.WARMUP_STEPS` steps left out.

The fan-in FFN merges every attention rank's tokens per layer, so the ranks step in lockstep and a rank's step
includes waiting for the slowest; :func:`measure_vllm_step` reports the slowest rank's median.
"""

from __future__ import annotations

import importlib.util
import itertools
import statistics
import sys
import time
from typing import Any

from afd_sdk.errors import AFDConfigError, AFDError
from afd_sdk.plan.model import Deployment
from afd_sdk.plan.sweep import WARMUP_STEPS, per_rank_prompts
from afd_sdk.runtime.world import FAIL_FAST_S, free_port_block, run_world, worker_main

__all__ = ["measure_vllm_step", "require_vllm"]

#: the engine arguments an FFN rank shares with its attention engines
SCHEDULER_KEYS = ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "seed", "enable_prefix_caching")


def require_vllm(command: str) -> None:
    """Raise :class:`AFDConfigError` before anything starts unless vLLM imports here (``command``: what to rerun
    in the vLLM environment)."""
    if importlib.util.find_spec("vllm") is None:
        raise AFDConfigError(
            f"a vLLM-engine plan needs vLLM in this environment; create it with ./scripts/bootstrap-vllm.sh and run "
            f".venv-vllm/bin/{command}",
            key="engine",
            value="vllm",
        )


def _worker(spec: dict[str, Any], out: dict[str, Any]) -> None:
    from afd_sdk.plan.vllm_curves import plan_engine_kwargs

    role, rank = spec["role"], spec["rank"]
    context = spec.get("context")
    ids = spec.get("input_ids") or spec["shape_ids"]
    steps = 1 + spec["warmup"] + spec["repeat"]
    afd = {**spec["afd"], "role": role, "server_rank": rank}
    kwargs = plan_engine_kwargs(
        spec["model_dir"], afd, len(ids), spec["tokens_per_request"], [context] if context else [], steps
    )
    if role == "ffn":
        from afd_sdk.integrations.vllm.ffn import open_ffn_role
        from afd_sdk.runtime.worlds import served

        # the attention engines' scheduler shapes: the FFN takes as many tokens per exchange as they send
        shapes = {k: kwargs[k] for k in SCHEDULER_KEYS}
        ffn = open_ffn_role(spec["model_dir"], afd, rank=rank, **shapes)
        (stats,) = served(ffn.serve())
        out["serve"] = stats.as_dict()
        return
    from vllm import LLM, SamplingParams

    from afd_sdk.plan.vllm_curves import Forward, hook_forwards

    llm = LLM(**kwargs)
    forwards: list[Forward] = []
    llm.apply_model(lambda model: hook_forwards(model, forwards))
    greedy = {"temperature": 0.0, "detokenize": False, "ignore_eos": True}
    prompts = [{"prompt_token_ids": p} for p in ids]
    try:
        if context:
            llm.generate(prompts, SamplingParams(max_tokens=steps + 1, **greedy), use_tqdm=False)
            starts = [f.start_ns for f in forwards[1:]]  # forwards[0] is the prompts' prefill
            if len(starts) != steps:
                raise AFDError(f"the vLLM engine ran {len(starts)} decode forwards; expected {steps}")
            samples = [(b - a) / 1e9 for a, b in itertools.pairwise(starts)][spec["warmup"] :]
        else:
            samples = []
            one = SamplingParams(max_tokens=1, **greedy)
            for step in range(spec["warmup"] + spec["repeat"]):
                forwards.clear()
                t0 = time.perf_counter()
                llm.generate(prompts, one, use_tqdm=False)
                wall = time.perf_counter() - t0
                if len(forwards) != 1:
                    raise AFDError(f"a prefill call ran {len(forwards)} engine forwards; expected one")
                if step >= spec["warmup"]:
                    samples.append(wall)
        out["step_ms"] = statistics.median(samples) * 1000
        out["samples_ms"] = [s * 1000 for s in samples]
    finally:
        out["goodbye_sent"] = all(llm.collective_rpc("afd_close_connector"))


def measure_vllm_step(
    dep: Deployment,
    *,
    connector: str,
    model_dir: str,
    vocab_size: int,
    tokens_per_request: int,
    repeat: int = 10,
    warmup: int = WARMUP_STEPS,
    seed: int = 0,
    timeout_s: float = 420.0,
    context: int | None = None,
) -> dict[str, Any]:
    """Run ``dep`` as vLLM engines for real; the result as :func:`afd_sdk.plan.sweep.measure_step`'s
    (``step_ms`` the slowest attention rank's median step, ``per_rank_ms`` each rank's); ``dep.stages`` is 1
    (:func:`afd_sdk.plan.validate.validate` checks it)."""
    from afd_sdk.integrations.vllm.demo import WORLD_ENV

    per_rank = per_rank_prompts(dep, vocab_size, context or tokens_per_request, seed)
    spec = {
        "afd": {
            "connector": connector,
            "host": "127.0.0.1",
            "port": free_port_block(64),
            "num_attention_ranks": dep.attention,
            "num_ffn_ranks": dep.ffn,
            "timeout_s": 120,
        },
        "model_dir": model_dir,
        "tokens_per_request": tokens_per_request,
        # the FFN ranks build their engine config for the same shapes as the attention ranks
        "shape_ids": [[0]] * dep.batch,
        "repeat": repeat,
        "warmup": warmup,
        "context": context,
    }
    world = run_world(
        spec,
        per_rank=per_rank,
        module="afd_sdk.plan.vllm_sweep",
        timeout_s=timeout_s,
        env=dict(WORLD_ENV),
        fail_fast_s=FAIL_FAST_S,
    )
    if not all(r.ok for r in world.ranks):
        raise AFDError(f"measuring {dep.label} in vLLM over {connector} failed:\n{world.describe()}")
    ranks = [r.result["step_ms"] for r in world.by_role("attention")]
    return {"step_ms": max(ranks), "per_rank_ms": ranks}


if __name__ == "__main__":
    sys.exit(worker_main(_worker, sys.argv))
