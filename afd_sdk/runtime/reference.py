"""Native reference: the unsplit transformers model on the same stage grouping."""

from __future__ import annotations

import torch

from afd_sdk.runtime.attention_runner import GenerateResult, cache_kwarg, cache_of
from afd_sdk.topology import even_blocks

__all__ = ["compare", "reference_generate"]


@torch.inference_mode()
def reference_generate(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, num_stages: int
) -> GenerateResult:
    """Greedy generation with the native model, each stage as its own batch (as the runner does)."""
    result = GenerateResult([[] for _ in prompts], [])
    cache_kw = cache_kwarg(model)
    stages = [range(a, b) for a, b in even_blocks(len(prompts), num_stages) if b > a]
    state = [(r, torch.tensor([prompts[i] for i in r], dtype=torch.long), None) for r in stages]
    for _ in range(max_new_tokens):
        logits_all, nxt_state = [], []
        for reqs, ids, cache in state:
            out = model(input_ids=ids, use_cache=True, **{cache_kw: cache})
            logits = out.logits[:, -1, :].float()
            logits_all.append(logits)
            nxt = logits.argmax(dim=-1)
            for j, req in enumerate(reqs):
                result.tokens[req].append(int(nxt[j]))
            nxt_state.append((reqs, nxt[:, None], cache_of(out)))
        state = nxt_state
        result.logits.append(torch.cat(logits_all))
    return result


def compare(split: GenerateResult, native: GenerateResult) -> dict[str, object]:
    """Per-step max |logit diff| and whether greedy tokens agree."""
    diffs = [float((a - b).abs().max()) for a, b in zip(split.logits, native.logits, strict=True)]
    return {
        "max_abs_diff_per_step": diffs,
        "max_abs_diff": max(diffs) if diffs else 0.0,
        "tokens_equal": split.tokens == native.tokens,
    }
