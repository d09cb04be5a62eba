"""One process of a vLLM AFD world: ``python -m afd_sdk.integrations.vllm.worker SPEC_JSON``.

Roles (``spec["role"]``):

* ``ffn`` — :func:`~afd_sdk.integrations.vllm.ffn.open_ffn_role` and serve until goodbye;
* ``attention`` — ``vllm.LLM`` with ``additional_config={"afd": {...}}`` (the
  ``AFD<arch>`` alias in vLLM's engine), all prompts submitted at once so the
  scheduler batches them continuously; then the engine's model closes its
  connector (the goodbye) through ``LLM.apply_model``;
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

__all__ = ["close_attention_side", "describe_cut", "generate", "run"]


def close_attention_side(model: Any) -> bool:
    """``LLM.apply_model`` target: say goodbye to the FFN peers from inside the engine's worker."""
    side = getattr(model, "afd_attention", None)
    if side is None:
        return False
    side.close()
    return True


def describe_cut(model: Any) -> dict[str, Any]:
    """What one role's model holds at the cut (``LLM.apply_model`` target, and the FFN role's check).

    ``remote_ffn``: parameter-free FFN proxies; ``ffn_params`` / ``other_params``:
    parameters inside / outside the decoder layers' FFN modules;
    ``attention_modules``: modules whose class is an attention layer.
    """
    from afd_sdk.proxy import RemoteFFN

    ffn_params = sum(".mlp." in f".{name}" for name, _ in model.named_parameters())
    total = sum(1 for _ in model.named_parameters())
    return {
        "remote_ffn": sum(isinstance(m, RemoteFFN) for m in model.modules()),
        "ffn_params": ffn_params,
        "other_params": total - ffn_params,
        "attention_modules": sum("Attention" in type(m).__name__ for m in model.modules()),
        "classes": sorted({type(m).__name__ for m in model.modules()}),
    }


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
    from afd_sdk.integrations.vllm.ffn import engine_kwargs, open_ffn_role

    role, rank = spec["role"], spec["rank"]
    dtype = spec.get("dtype", "float32")
    engine = dict(spec.get("engine", {}))
    report_progress(spec, event="loading")
    if role == "ffn":
        ffn = open_ffn_role(spec["model_dir"], spec["afd"], rank=rank, dtype=dtype, **engine)
        out["cut"] = describe_cut(ffn.model)
        report_progress(spec, event="ready")
        out["serve"] = ffn.serve().as_dict()
        return
    from vllm import LLM

    afd = None if role == "native" else {**spec["afd"], "role": "attention", "server_rank": rank}
    llm = LLM(**engine_kwargs(spec["model_dir"], afd, dtype=dtype, **engine))
    report_progress(spec, event="ready")
    if afd is None:  # the reference: each attention rank's prompt set as that engine batches it
        out["sets"] = [generate(llm, s["prompts"], s["max_tokens"]) for s in spec["prompt_sets"]]
        return
    out["cut"] = llm.apply_model(describe_cut)[0]
    try:
        out.update(generate(llm, spec["prompts"], spec["max_tokens"]))
    finally:
        out["goodbye_sent"] = all(llm.apply_model(close_attention_side))


if __name__ == "__main__":
    sys.exit(worker_main(run, sys.argv))
