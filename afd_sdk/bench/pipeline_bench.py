"""``afd bench pipeline``: what micro-batching buys, and what the SDK costs per layer.

In one run of one Attention and one FFN process, on one seeded MoE checkpoint
sized so attention and FFN work are comparable, every mode taking turns (see
:func:`interleaved_medians`):

* ``T_attn``: the Attention-role model alone (FFN proxies answered by a
  null connector), in the attention process, one thread;
* ``T_ffn``: the FFN blocks alone on the same tokens;
* both again on the two stages' micro-batches, one after the other: the work a
  2-stage step really has (on CPU, two half batches cost more than one whole
  batch: smaller GEMMs and the expert loop's fixed cost per call);
* ``T1`` / ``T2``: a real split step (Attention and FFN processes over the
  connector) with 1 and with 2 stages;
* overlap efficiency ``(T1 - T2) / (T1 - max(T_attn, T_ffn))`` with the
  micro-batched ``T_attn`` and ``T_ffn``, since a perfect 2-stage pipeline
  reaches the larger of those: 1.0 means stage 2's attention hides completely
  behind stage 1's FFN. The same with the whole-batch times is reported next to it;
* per-layer SDK overhead, excluding the transport: the FFN proxy plus metadata
  lookup (null connector) and the ZMQ connector's framing of both messages
  (cached header, wire part, header lookup, receive view, payload).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from afd_sdk.runtime.world import FAIL_FAST_S, free_port_block, run_world, worker_main
from afd_sdk.topology import even_blocks
from afd_sdk.wire import A2FPayload, TensorHeader, TransferMetadata

__all__ = ["BENCH_CONFIGS", "bench_config", "run_pipeline_benchmark", "save_bench_checkpoint"]

#: balanced-ish shapes per architecture (hidden 512, 12 layers); token batch chosen by --tokens. 12 layers, not
#: 4: a 2-stage step fills and drains its pipeline once, and with 4 layers that fixed cost read as a third of
#: the overlap missing (efficiency 0.55-0.73 at 4 layers, 0.70-0.89 at 12, the same code and machine)
BENCH_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3MoeForCausalLM": dict(
        model_type="qwen3_moe",
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,  # decode calibration's KV-cache contexts (afd plan calibrate --context)
        moe_intermediate_size=384,
        num_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
}


class NullConnector:
    """Answers every FFN call with zeros at no transport cost (attention-only timing); also a routed dispatch
    (gate on Attention: ``topk_ids``/``topk_weights``), whose combined output is zeros as well."""

    def __init__(self, context: Any = None) -> None:
        self.context = context
        self._out: torch.Tensor | None = None
        #: when a list: every hidden-states tensor sent is appended (a copy), in call order
        self.captured: list[torch.Tensor] | None = None
        #: when a list: every routed dispatch's ``topk_ids`` (a copy), in call order
        self.captured_topk: list[torch.Tensor] | None = None

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
    ) -> None:
        if self._out is None or self._out.shape != hidden_states.shape:
            self._out = torch.zeros_like(hidden_states)
        if self.captured is not None:
            self.captured.append(hidden_states.clone())
        if self.captured_topk is not None and topk_ids is not None:
            self.captured_topk.append(topk_ids.clone())

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


def interleaved_medians(modes: Mapping[str, Callable[[], object]], repeat: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per mode, the modes taking turns: round ``r`` times every mode once, in rotated order.

    Timing one mode after the other lets the host's load drift between them (on a shared 2-vCPU machine it
    moves step times by 10–30 % within a minute); taking turns exposes every mode to the same drift.
    """
    names = list(modes)
    for name in names:
        for _ in range(warmup):
            modes[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            modes[name]()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in samples.items()}


def _load_role(
    model_dir: str, arch: str, role: str, provider: Any = None, *, compute_gate_on_attention: bool = False
) -> Any:
    """``role``'s model from the transformers binding, as the runtime loads it (``provider``: the attention role's;
    ``compute_gate_on_attention``: the roles of routed dispatch, the FFN's holding every expert)."""
    from afd_sdk.plugins import get_plugin_manager
    from afd_sdk.weights import read_hf_config

    adapter = get_plugin_manager().adapter_class(arch)(arch, read_hf_config(model_dir))
    binding = adapter.binding("transformers")
    model, _ = binding.load_role(
        adapter, model_dir, role, provider=provider, compute_gate_on_attention=compute_gate_on_attention
    )
    return model


def _local_modes(model_dir: str, arch: str, input_ids: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The in-process timings: attention alone and FFN alone, whole batch and micro-batched."""
    from afd_sdk.metadata import ContextVarMetadataProvider, ForwardMetadata

    provider = ContextVarMetadataProvider()
    attn = _load_role(model_dir, arch, "attention", provider)
    ffn = _load_role(model_dir, arch, "ffn")
    null = NullConnector()
    n = input_ids.numel()
    md = ForwardMetadata(0, 1, (0,), (n,), (n,), (0,), null)  # type: ignore[arg-type]

    # the 2-stage step's micro-batches: the runner's own split of the requests
    micro_ids = [input_ids[a:b] for a, b in even_blocks(input_ids.shape[0], 2) if b > a]
    micro_md = [ForwardMetadata(0, 1, (0,), (m.numel(),), (m.numel(),), (0,), null) for m in micro_ids]  # type: ignore[arg-type]

    def attention_only() -> None:
        with torch.inference_mode(), provider.install(md):
            attn(input_ids=input_ids, use_cache=False)

    def attention_micro() -> None:
        with torch.inference_mode():
            for ids, m in zip(micro_ids, micro_md, strict=True):
                with provider.install(m):
                    attn(input_ids=ids, use_cache=False)

    layers = len(ffn.blocks)
    # the FFN gets hidden states the attention model sends (past the null connector's zero FFN outputs), not
    # randn: MoE routing, and so each expert's batch, depends on them
    null.captured = []
    attention_only()
    hs, null.captured = null.captured, None
    micro_hs = [list(h.split([m.numel() for m in micro_ids])) for h in hs]

    def ffn_only() -> None:
        with torch.inference_mode():
            for layer in range(layers):
                ffn(layer, hs[layer], {})

    def ffn_micro() -> None:
        with torch.inference_mode():
            for layer in range(layers):
                for part in micro_hs[layer]:
                    ffn(layer, part, {})

    return {"t_attn": attention_only, "t_attn_micro": attention_micro, "t_ffn": ffn_only, "t_ffn_micro": ffn_micro}


def _proxy_metadata_us(model_dir: str, arch: str) -> float:
    """Per-layer cost of the FFN proxy and its metadata lookup: the proxy with a null connector minus calling the
    null connector directly (in the parent, before the world starts: no other thread runs)."""
    from afd_sdk.metadata import ContextVarMetadataProvider, ForwardMetadata

    provider = ContextVarMetadataProvider()
    attn = _load_role(model_dir, arch, "attention", provider)
    hidden = int(attn.config.hidden_size)
    null = NullConnector()
    md = ForwardMetadata(0, 1, (0,), (8,), (8,), (0,), null)  # type: ignore[arg-type]
    proxy = attn.model.layers[0].mlp
    x = torch.randn(1, 8, hidden)
    flat = x.reshape(-1, hidden)
    tm = TransferMetadata(0, 0, (8,))

    # under inference mode, as the attention runner calls the model
    def via_proxy() -> None:
        with torch.inference_mode(), provider.install(md):
            for _ in range(1000):
                proxy(x)

    def direct() -> None:
        with torch.inference_mode():
            for _ in range(1000):
                null.send_attn_output(flat, tm)
                null.recv_ffn_output(flat, 0)

    return max((_median_time(via_proxy, 7) - _median_time(direct, 7)) / 1000 * 1e6, 0.0)


def _framing_us(t: torch.Tensor) -> float:
    """Framing of one message in steady state, sender and receiver, as the ZMQ connector does it on its native
    wire (:mod:`afd_connectors.zmq.wire`).

    The sender takes the header from a :class:`~afd_sdk.control.HeaderCache` (every step repeats each layer's
    header) and hands the tensor to the wire as ``(tensor, address, nbytes)``; the receiver looks the header
    bytes up among those it validated before, takes its cached view of the receive area the wire copied into,
    and builds the payload the FFN gets.
    """
    from afd_sdk.control import HeaderCache, spec_of
    from afd_sdk.wire import TensorHeader

    sender, receiver = HeaderCache(), HeaderCache()
    spec = spec_of("hidden_states", t)
    n = t.shape[0]
    area = torch.empty(t.nbytes, dtype=torch.uint8)
    views: dict[bytes, torch.Tensor] = {}

    def once() -> None:
        with torch.inference_mode():  # as the runtime frames every message
            for layer in range(1000):
                key = (layer, 0, n, t.dtype)
                raw = sender.encoded(key, lambda layer=layer: TensorHeader("a2f", layer, 0, (n,), (spec,)))
                _part = (t, t.data_ptr(), t.nbytes)
                got = receiver.decoded(raw, _no_problem)
                view = views.get(raw)
                if view is None:
                    view = views[raw] = area.view(t.dtype).view(got.tensors[0].shape)
                A2FPayload(view, TransferMetadata(got.layer_idx, got.stage_idx, got.seq_lens), {})

    return _median_time(once, 7) / 1000 * 1e6


def _no_problem(header: TensorHeader) -> None:
    return None


def _stage_configs(spec: Mapping[str, Any], role: str) -> list[dict[str, Any]]:
    """The two worlds of one run: 1 stage on the first port, 2 stages on the second."""
    return [
        {**spec["afd"], "role": role, "port": port, "num_stages": stages}
        for stages, port in zip((1, 2), spec["ports"], strict=True)
    ]


def _worker(spec: dict[str, Any], out: dict[str, Any]) -> None:
    """One process per role; each opens both worlds (1 and 2 stages), so every mode runs on the same host load."""
    from afd_sdk.runtime.attention_runner import AttentionRunner
    from afd_sdk.runtime.heap import freeze_startup_heap
    from afd_sdk.runtime.session import open_role
    from afd_sdk.runtime.worlds import serve_worlds, served

    torch.set_num_threads(1)
    sessions = [open_role(cfg, spec["model_dir"], role_rank=spec["rank"]) for cfg in _stage_configs(spec, spec["role"])]
    if spec["role"] == "ffn":  # one thread per world; serve_worlds initialises and closes the connectors
        freeze_startup_heap()
        outcomes = serve_worlds([s.connector for s in sessions], sessions[0].model)
        out["serve"] = [stats.as_dict() for stats in served(outcomes)]
        return
    try:
        for session in sessions:
            session.connector.init()
        freeze_startup_heap()
        ids = torch.tensor(spec["input_ids"], dtype=torch.long)
        modes: dict[str, Callable[[], object]] = {}
        for name, session in zip(("t1", "t2"), sessions, strict=True):
            runner = AttentionRunner.for_session(session)
            step = iter(range(10**9))
            modes[name] = lambda runner=runner, step=step: runner.step(ids, next(step))
        modes.update(_local_modes(spec["model_dir"], spec["arch"], ids))
        out["times_ms"] = {k: v * 1000 for k, v in interleaved_medians(modes, spec["repeat"]).items()}
    finally:
        for session in sessions:
            session.connector.close()


def bench_config(arch: str, layers: int | None = None) -> Any:
    """``arch``'s bench configuration as a transformers config, with ``layers`` decoder layers if given (checked
    before anything is built)."""
    from transformers import AutoConfig

    from afd_sdk.errors import AFDConfigError

    if arch not in BENCH_CONFIGS:
        raise AFDConfigError(
            f"--arch {arch!r} has no bench config; expected one of {sorted(BENCH_CONFIGS)}", key="arch", value=arch
        )
    cfg_kw = dict(BENCH_CONFIGS[arch])
    if layers is not None:
        if layers < 1:
            raise AFDConfigError(f"layers={layers}; expected an int >= 1", key="layers", value=layers)
        cfg_kw["num_hidden_layers"] = layers
    return AutoConfig.for_model(cfg_kw.pop("model_type"), **cfg_kw)


def save_bench_checkpoint(arch: str, config: Any, directory: str, seed: int = 0) -> None:
    """A seeded random checkpoint of ``config`` (from :func:`bench_config`) in ``directory``."""
    import transformers
    from transformers.utils import logging as hf_logging

    torch.manual_seed(seed)
    hf_logging.disable_progress_bar()
    getattr(transformers, arch)(config).save_pretrained(directory)


def run_pipeline_benchmark(
    *,
    arch: str = "Qwen3MoeForCausalLM",
    connector: str = "zmq",
    requests: int = 4,
    tokens: int = 128,
    repeat: int = 15,
    seed: int = 0,
    layers: int | None = None,
) -> dict[str, Any]:
    """Measure T_attn, T_ffn, T1, T2, overlap efficiency and per-layer SDK overhead in one run.

    ``layers`` overrides the bench config's decoder layers (12): the pipeline fills and drains once per step,
    so a deeper model spreads that over more overlapped layers.
    """
    from afd_sdk.errors import AFDError

    config = bench_config(arch, layers)
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, config.vocab_size, (requests, tokens), generator=g)

    with tempfile.TemporaryDirectory(prefix="afd-bench-") as tmp:
        save_bench_checkpoint(arch, config, tmp, seed)
        torch.set_num_threads(1)
        proxy_us = _proxy_metadata_us(tmp, arch)
        base = free_port_block(64)
        spec = {
            "afd": {"connector": connector, "port": base, "timeout_s": 60},
            "ports": [base, base + 32],
            "model_dir": tmp,
            "arch": arch,
            "input_ids": input_ids.tolist(),
            "repeat": repeat,
        }
        world = run_world(spec, module="afd_sdk.bench.pipeline_bench", timeout_s=600, fail_fast_s=FAIL_FAST_S)
        if not all(r.ok for r in world.ranks):
            raise AFDError(f"pipeline benchmark failed:\n{world.describe()}")
        (attn,) = world.by_role("attention")
        (ffn,) = world.by_role("ffn")
    times = attn.result["times_ms"]
    # the FFN's compute per step as its server measured it, in the 1-stage and the 2-stage world
    ffn_compute = [served["compute_s"] / max(1, served["steps"]) * 1000 for served in ffn.result["serve"]]
    # the same server's wall time per step (its whole serve(), idle between steps included): the compute's bound
    ffn_serve = [served["wall_s"] / max(1, served["steps"]) * 1000 for served in ffn.result["serve"]]
    framing = _framing_us(torch.randn(8, int(config.hidden_size)))
    t1, t2 = times["t1"], times["t2"]

    def efficiency_against(bound: float) -> float:
        return (t1 - t2) / (t1 - bound) if t1 > bound else float("nan")

    # a perfect 2-stage pipeline ends after the larger of the two roles' micro-batched work
    bound = max(times["t_attn_micro"], times["t_ffn_micro"])
    whole_batch_bound = max(times["t_attn"], times["t_ffn"])
    bound_in_run = max(times["t_attn_micro"], ffn_compute[1])
    return {
        "architecture": arch,
        "connector": connector,
        "tokens_per_step": requests * tokens,
        "t_attn_ms": times["t_attn"],
        "t_ffn_ms": times["t_ffn"],
        "t_attn_micro_ms": times["t_attn_micro"],
        "t_ffn_micro_ms": times["t_ffn_micro"],
        "t1_ms": t1,
        "t2_ms": t2,
        "overlap_efficiency": efficiency_against(bound),
        "overlap_efficiency_whole_batch": efficiency_against(whole_batch_bound),
        "ffn_compute_ms_1_stage": ffn_compute[0],
        "ffn_compute_ms_2_stages": ffn_compute[1],
        "ffn_serve_ms_per_step_2_stages": ffn_serve[1],
        "overlap_efficiency_in_run": efficiency_against(bound_in_run),
        "proxy_metadata_us_per_layer": proxy_us,
        "framing_us_per_message": framing,
        "sdk_overhead_us_per_layer": proxy_us + 2 * framing,
        "layers": int(config.num_hidden_layers),
    }


def main(argv: list[str]) -> int:
    return worker_main(_worker, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
