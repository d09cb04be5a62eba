"""``afd bench pipeline``: what micro-batching buys, and what the SDK costs per layer.

In one run, on one seeded MoE checkpoint sized so attention and FFN work are
comparable:

* ``T_attn``: the Attention-role model alone (FFN proxies answered by a
  null connector), one process, one thread;
* ``T_ffn``: the FFN blocks alone on the same tokens;
* ``T1`` / ``T2``: a real split step (Attention and FFN processes over the
  connector) with 1 and with 2 stages;
* overlap efficiency ``(T1 - T2) / (T1 - max(T_attn, T_ffn))``: 1.0 means stage
  2's attention hides completely behind stage 1's FFN;
* per-layer SDK overhead, excluding the transport: the FFN proxy plus metadata
  lookup (null connector) and the connector's framing (header build, encode,
  decode, buffer views).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import torch

from afd_sdk.runtime.world import FAIL_FAST_S, free_port_block, run_world, worker_main
from afd_sdk.wire import A2FPayload, TensorHeader, TransferMetadata

__all__ = ["BENCH_CONFIGS", "run_pipeline_benchmark"]

#: balanced-ish shapes per architecture (hidden 512, 4 layers); token batch chosen by --tokens
BENCH_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3MoeForCausalLM": dict(
        model_type="qwen3_moe", vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024,
        moe_intermediate_size=384, num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
    ),
}  # fmt: skip


class NullConnector:
    """Answers every FFN call with zeros at no transport cost (attention-only timing)."""

    def __init__(self, context: Any = None) -> None:
        self.context = context
        self._out: torch.Tensor | None = None

    def send_attn_output(self, hidden_states: torch.Tensor, metadata: TransferMetadata, *,
                         extras: Mapping[str, torch.Tensor] | None = None) -> None:  # fmt: skip
        if self._out is None or self._out.shape != hidden_states.shape:
            self._out = torch.zeros_like(hidden_states)

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        assert self._out is not None
        return self._out

    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        raise NotImplementedError("attention-only timing never receives on the FFN side")

    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        raise NotImplementedError("attention-only timing never sends on the FFN side")


def _median_time(fn: Any, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _local_times(model_dir: str, arch: str, input_ids: torch.Tensor, repeat: int) -> dict[str, float]:
    from afd_sdk.metadata import ContextVarMetadataProvider, ForwardMetadata
    from afd_sdk.plugins import get_plugin_manager
    from afd_sdk.weights import read_hf_config

    torch.set_num_threads(1)
    adapter = get_plugin_manager().adapter_class(arch)(arch, read_hf_config(model_dir))
    binding = adapter.binding("transformers")
    provider = ContextVarMetadataProvider()
    attn, _ = binding.load_role(adapter, model_dir, "attention", provider=provider)
    ffn, _ = binding.load_role(adapter, model_dir, "ffn")
    null = NullConnector()
    n = input_ids.numel()
    md = ForwardMetadata(0, 1, (0,), (n,), (n,), (0,), null)  # type: ignore[arg-type]

    def attention_only() -> None:
        with torch.inference_mode(), provider.install(md):
            attn(input_ids=input_ids, use_cache=False)

    hidden = int(read_hf_config(model_dir)["hidden_size"])
    layers = len(ffn.blocks)
    h = torch.randn(n, hidden)

    def ffn_only() -> None:
        with torch.inference_mode():
            for layer in range(layers):
                ffn(layer, h, {})

    # per-layer proxy + metadata cost: the proxy with a null connector minus calling the null connector directly
    proxy = attn.model.layers[0].mlp
    x = torch.randn(1, 8, hidden)
    flat = x.reshape(-1, hidden)
    tm = TransferMetadata(0, 0, (8,))

    def via_proxy() -> None:
        with provider.install(md):
            for _ in range(1000):
                proxy(x)

    def direct() -> None:
        for _ in range(1000):
            null.send_attn_output(flat, tm)
            null.recv_ffn_output(flat, 0)

    proxy_us = (_median_time(via_proxy, 7) - _median_time(direct, 7)) / 1000 * 1e6
    return {
        "t_attn_ms": _median_time(attention_only, repeat) * 1000,
        "t_ffn_ms": _median_time(ffn_only, repeat) * 1000,
        "proxy_metadata_us": max(proxy_us, 0.0),
        "framing_us": _framing_us(torch.randn(8, hidden)),
        "layers": layers,
    }


def _framing_us(t: torch.Tensor) -> float:
    """Byte-stream framing of one message in steady state, sender and receiver, as the ZMQ connector does it.

    The header comes from a :class:`~afd_sdk.control.HeaderCache` (every step repeats each layer's header),
    the tensor goes out as a byte view, and the receiver looks the header bytes up among those it
    validated before and takes its pooled receive view.
    """
    from afd_sdk.control import BufferPool, HeaderCache, spec_of, tensor_bytes
    from afd_sdk.wire import TensorHeader

    pool = BufferPool()
    sender, receiver = HeaderCache(), HeaderCache()
    spec = spec_of("hidden_states", t)
    n = t.shape[0]

    def once() -> None:
        for layer in range(1000):
            key = (layer, 0, n, t.dtype)
            raw = sender.encoded(key, lambda layer=layer: TensorHeader("a2f", layer, 0, (n,), (spec,)))
            tensor_bytes(t)
            got = receiver.decoded(raw, _no_problem)
            pool.tensor(("a2f", 0), got.tensors[0])

    return _median_time(once, 7) / 1000 * 1e6


def _no_problem(header: TensorHeader) -> None:
    return None


def _worker(spec: dict[str, Any], out: dict[str, Any]) -> None:
    from afd_sdk.runtime.attention_runner import AttentionRunner
    from afd_sdk.runtime.serve import server_for
    from afd_sdk.runtime.session import open_role

    torch.set_num_threads(1)
    session = open_role({**spec["afd"], "role": spec["role"]}, spec["model_dir"], role_rank=spec["rank"])
    conn = session.connector
    try:
        conn.init()
        if spec["role"] == "ffn":
            out["serve"] = server_for(conn, session.model).serve().as_dict()
            return
        runner = AttentionRunner(session.model, conn, session.provider, num_layers=session.num_layers,
                                 hidden_size=session.hidden_size, num_stages=session.config.num_stages)  # fmt: skip
        ids = torch.tensor(spec["input_ids"], dtype=torch.long)
        step = iter(range(10**9))
        out["step_s"] = _median_time(lambda: runner.step(ids, next(step)), spec["repeat"])
    finally:
        conn.close()


def run_pipeline_benchmark(
    *, arch: str = "Qwen3MoeForCausalLM", connector: str = "zmq", requests: int = 4, tokens: int = 128,
    repeat: int = 15, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Measure T_attn, T_ffn, T1, T2, overlap efficiency and per-layer SDK overhead in one run."""
    from afd_sdk.errors import AFDConfigError, AFDError

    if arch not in BENCH_CONFIGS:
        raise AFDConfigError(f"--arch {arch!r} has no bench config; expected one of {sorted(BENCH_CONFIGS)}",
                             key="arch", value=arch)  # fmt: skip
    import transformers
    from transformers import AutoConfig

    cfg_kw = dict(BENCH_CONFIGS[arch])
    config = AutoConfig.for_model(cfg_kw.pop("model_type"), **cfg_kw)
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, config.vocab_size, (requests, tokens), generator=g)
    from transformers.utils import logging as hf_logging

    with tempfile.TemporaryDirectory(prefix="afd-bench-") as tmp:
        torch.manual_seed(seed)
        hf_logging.disable_progress_bar()
        getattr(transformers, arch)(config).save_pretrained(tmp)
        local = _local_times(tmp, arch, input_ids, repeat)
        results: dict[int, float] = {}
        ffn_compute: dict[int, float] = {}
        for stages in (1, 2):
            spec = {"afd": {"connector": connector, "port": free_port_block(64), "num_stages": stages, "timeout_s": 60},
                    "model_dir": tmp, "input_ids": input_ids.tolist(), "repeat": repeat}  # fmt: skip
            world = run_world(spec, module="afd_sdk.bench.pipeline_bench", timeout_s=600, fail_fast_s=FAIL_FAST_S)
            if not all(r.ok for r in world.ranks):
                raise AFDError(f"pipeline benchmark ({stages} stage(s)) failed:\n{world.describe()}")
            (attn,) = world.by_role("attention")
            (ffn,) = world.by_role("ffn")
            results[stages] = attn.result["step_s"] * 1000
            served = ffn.result["serve"]
            ffn_compute[stages] = served["compute_s"] / max(1, served["steps"]) * 1000
    t1, t2 = results[1], results[2]
    bound = max(local["t_attn_ms"], local["t_ffn_ms"])
    efficiency = (t1 - t2) / (t1 - bound) if t1 > bound else float("nan")
    # what the FFN really computed per step inside the 2-stage run (two half batches, next to attention's compute)
    bound_in_run = max(local["t_attn_ms"], ffn_compute[2])
    in_run = (t1 - t2) / (t1 - bound_in_run) if t1 > bound_in_run else float("nan")
    return {
        "architecture": arch,
        "connector": connector,
        "tokens_per_step": requests * tokens,
        "t_attn_ms": local["t_attn_ms"],
        "t_ffn_ms": local["t_ffn_ms"],
        "t1_ms": t1,
        "t2_ms": t2,
        "overlap_efficiency": efficiency,
        "ffn_compute_ms_1_stage": ffn_compute[1],
        "ffn_compute_ms_2_stages": ffn_compute[2],
        "overlap_efficiency_in_run": in_run,
        "proxy_metadata_us_per_layer": local["proxy_metadata_us"],
        "framing_us_per_message": local["framing_us"],
        "sdk_overhead_us_per_layer": local["proxy_metadata_us"] + 2 * local["framing_us"],
        "layers": local["layers"],
    }


def main(argv: list[str]) -> int:
    return worker_main(_worker, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
