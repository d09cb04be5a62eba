"""One rank of a split model: ``python -m afd_sdk.runtime.worker SPEC_JSON``.

Used by ``afd demo`` and the end-to-end tests. The FFN rank serves until
goodbye; an Attention rank generates, closes its connector, then (with
``reference``) runs the native model on the same input and compares.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import torch

from afd_sdk.runtime.attention_runner import AttentionRunner
from afd_sdk.runtime.heap import freeze_startup_heap
from afd_sdk.runtime.reference import compare, reference_generate
from afd_sdk.runtime.serve import server_for
from afd_sdk.runtime.session import open_role
from afd_sdk.runtime.world import report_progress, worker_main


def run(spec: dict[str, Any], out: dict[str, Any]) -> None:
    torch.set_num_threads(int(spec.get("threads", 1)))
    role, rank = spec["role"], spec["rank"]
    report_progress(spec, event="loading")
    session = open_role({**spec["afd"], "role": role}, spec["model_dir"], role_rank=rank)
    conn = session.connector
    try:
        conn.init()
        freeze_startup_heap()
        report_progress(spec, event="ready")
        if role == "ffn":
            out["serve"] = server_for(conn, session.model).serve().as_dict()
            return
        runner = AttentionRunner.for_session(session, record_exchanges=True)
        prompts = spec["prompts"]
        result = runner.generate(
            prompts, spec["max_new_tokens"], on_step=lambda k, n: report_progress(spec, event="step", step=k, of=n)
        )
    finally:
        conn.close()
    out.update(
        tokens=result.tokens,
        step_s=result.step_s,
        exchange_us_median=statistics.median(result.exchange_us) if result.exchange_us else None,
        exchanges=len(result.exchange_us),
    )
    if spec.get("reference", True):
        report_progress(spec, event="reference")
        native = session.binding.load_native(spec["model_dir"])
        ref = reference_generate(native, prompts, spec["max_new_tokens"], session.config.num_stages)
        out.update(compare(result, ref))
        out["native_tokens"] = ref.tokens


if __name__ == "__main__":
    sys.exit(worker_main(run, sys.argv))
