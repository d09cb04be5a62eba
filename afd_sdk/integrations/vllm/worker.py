"""One process of a vLLM AFD world: ``python -m afd_sdk.integrations.vllm.worker SPEC_JSON``.

Roles (``spec["role"]``):

* ``ffn`` — :func:`~afd_sdk.integrations.vllm.ffn.open_ffn_role` and serve until goodbye;
* ``attention`` — ``vllm.LLM`` with ``additional_config={"afd": {...}}`` (the
  ``AFD<arch>`` alias in vLLM's engine), all prompts submitted at once so the
  scheduler batches them continuously; then the engine's worker closes its
  connector (the goodbye) through ``LLM.collective_rpc("afd_close_connector")``;
* ``native`` — plain vLLM (no AFD), the reference: each attention rank's
  prompt set (``prompt_sets``) in its own ``generate`` call, as that engine batched it.

Spec keys: ``model_dir``, ``prompts`` (token-id lists), ``max_tokens`` (one
per prompt), ``afd`` (the AFD mapping without role), ``dtype``, ``engine``
(further ``vllm.LLM`` arguments) and the launcher's ``rank`` / result paths.
The result holds per prompt the generated tokens and each sampled token's
logprob.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from afd_sdk.runtime.world import report_progress, worker_main

__all__ = ["generate", "run"]


def generate(llm: Any, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
    """Greedy generation of every prompt in one ``LLM.generate`` call: tokens and sampled-token logprobs."""
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=1, detokenize=False) for n in max_tokens]
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens, logprobs = [], []
    for out in outputs:
        comp = out.outputs[0]
        tokens.append(list(comp.token_ids))
        logprobs.append([float(step[t].logprob) for t, step in zip(comp.token_ids, comp.logprobs, strict=True)])
    return {"tokens": tokens, "logprobs": logprobs, "generate_s": wall}


def run(spec: dict[str, Any], out: dict[str, Any]) -> None:
    from afd_sdk.integrations.vllm.extension import describe_cut
    from afd_sdk.integrations.vllm.ffn import engine_kwargs, open_ffn_role
    from afd_sdk.runtime.worlds import served

    role, rank = spec["role"], spec["rank"]
    dtype = spec.get("dtype", "float32")
    engine = dict(spec.get("engine", {}))
    report_progress(spec, event="loading")
    if role == "ffn":
        ffn = open_ffn_role(spec["model_dir"], spec["afd"], rank=rank, dtype=dtype, **engine)
        out["cut"] = describe_cut(ffn.model)
        report_progress(spec, event="ready")
        (stats,) = served(ffn.serve())
        out["serve"] = stats.as_dict()
        return
    from vllm import LLM

    afd = None if role == "native" else {**spec["afd"], "role": "attention", "server_rank": rank}
    llm = LLM(**engine_kwargs(spec["model_dir"], afd, dtype=dtype, **engine))
    report_progress(spec, event="ready")
    if afd is None:  # the reference: each attention rank's prompt set as that engine batches it
        out["sets"] = [generate(llm, s["prompts"], s["max_tokens"]) for s in spec["prompt_sets"]]
        return
    out["cut"] = llm.collective_rpc("afd_describe_cut")[0]
    try:
        out.update(generate(llm, spec["prompts"], spec["max_tokens"]))
    finally:
        out["goodbye_sent"] = all(llm.collective_rpc("afd_close_connector"))


if __name__ == "__main__":
    sys.exit(worker_main(run, sys.argv))
