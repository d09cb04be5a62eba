"""``afd plan calibrate --engine vllm``: the compute curves measured with vLLM's own kernels, in this process.

One in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one OpenMP thread) runs the AFD Attention role of
the bench checkpoint exactly as ``vllm serve --additional-config '{"afd": ...}'`` would, with one difference: its
connector is :class:`LocalNullConnector`, registered in this process for the calibration only, which answers every
FFN call with zeros and keeps a copy of what was sent. Forward hooks on the model time each forward, so what is
measured is vLLM's model forward (attention kernels, paged KV cache, norms, embedding, LM head), not its scheduler:

* attention per layer vs tokens: one prefill forward of ``r`` prompts of ``tokens_per_request`` tokens;
* decode attention per layer vs requests, per context: the forwards of ``r`` new tokens after prompts of that
  context (the cache grows by :data:`DECODE_TOKENS` over the timed forwards);
* FFN per layer vs tokens: vLLM's FFN role (``open_ffn_role``, as ``afd ffn serve --engine vllm`` builds it) on
  the hidden states the attention model sent, prefill rows and decode rows (one per request) apart.

The step overheads (vLLM's scheduler, sampling, output processing; the FFN server's loop) are not measured here:
:func:`afd_sdk.plan.calibrate.calibrate` fits them to real worlds of vLLM engines (:mod:`afd_sdk.plan.vllm_sweep`).

Fan-in dispatch only (the routed gate-on-Attention role is calibrated on the reference runtime).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import torch

from afd_sdk.connector import AFDConnector
from afd_sdk.errors import ConnectorError
from afd_sdk.hookspecs import hookimpl
from afd_sdk.plan.ffn_modes import FFNModes
from afd_sdk.plan.profile import Curve
from afd_sdk.wire import A2FPayload, TransferMetadata

__all__ = [
    "DECODE_TOKENS",
    "Forward",
    "LocalNullConnector",
    "VllmCurves",
    "hook_forwards",
    "measure_vllm_curves",
    "plan_engine_kwargs",
]

#: decode forwards timed per (context, requests) and round, after the prompt's prefill
DECODE_TOKENS = 6
#: the in-process connector's registered name (never in an entry point: users cannot configure it)
NULL_CONNECTOR = "afd-plan-local-null"


class LocalNullConnector(AFDConnector):
    """The attention side of a world without an FFN: zeros back, no transport, no control plane.

    Registered in-process by :func:`measure_vllm_curves` only. Each instance appends itself to
    :attr:`instances`, so the calibration reaches the one the engine built; with :attr:`captured` a list,
    every hidden-states tensor sent is kept (a copy: vLLM's buffers are reused).
    """

    name: ClassVar[str] = NULL_CONNECTOR
    requires_control_plane: ClassVar[bool] = False
    instances: ClassVar[list[LocalNullConnector]] = []

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._out: torch.Tensor | None = None
        self.captured: list[torch.Tensor] | None = None
        LocalNullConnector.instances.append(self)

    def open(self) -> None:
        """Nothing to open: the FFN is not there."""

    def release(self) -> None:
        self._out = None

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        if self._out is None or self._out.shape != hidden_states.shape:
            self._out = torch.zeros_like(hidden_states)
        if self.captured is not None:
            self.captured.append(hidden_states.clone())

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        if self._out is None or self._out.shape != ref_tensor.shape:
            raise ConnectorError(f"{NULL_CONNECTOR}: recv_ffn_output of shape {tuple(ref_tensor.shape)} before a send")
        return self._out

    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        raise ConnectorError(f"{NULL_CONNECTOR} has no FFN side; it calibrates the attention role alone")

    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        raise ConnectorError(f"{NULL_CONNECTOR} has no FFN side; it calibrates the attention role alone")


class _NullPlugin:
    """The in-process plugin registering :class:`LocalNullConnector` for the calibration's duration."""

    @hookimpl
    def afd_register_connectors(self, register: Any) -> None:
        register(NULL_CONNECTOR, LocalNullConnector)


class VllmCurves:
    """What :func:`measure_vllm_curves` returns (per layer, microseconds)."""

    def __init__(
        self,
        attention_us: Curve,
        ffn_us: Curve,
        decode_us: dict[int, Curve],
        decode_ffn_us: Curve | None,
    ) -> None:
        self.attention_us, self.ffn_us = attention_us, ffn_us
        self.decode_us, self.decode_ffn_us = decode_us, decode_ffn_us


def _environment() -> None:
    from afd_sdk.integrations.vllm.demo import WORLD_ENV

    for key, value in WORLD_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine's model must run in this process


def measure_vllm_curves(
    model_dir: str,
    layers: int,
    tokens_per_request: int,
    requests: Sequence[int],
    max_group: int,
    repeat: int,
    contexts: Sequence[int],
    progress: Callable[[str], None] = lambda _what: None,
) -> VllmCurves:
    """The curves of the module docstring on the checkpoint in ``model_dir`` (``requests`` ascending)."""
    _environment()
    from vllm import LLM, SamplingParams  # calibrate() checked that it is there

    from afd_sdk.integrations.vllm.ffn import open_ffn_role
    from afd_sdk.plugins import get_plugin_manager
    from afd_sdk.runtime.world import free_port_block
    from afd_sdk.weights import read_hf_config

    pm = get_plugin_manager()
    plugin_name = "afd-plan-vllm-calibration"
    pm.register_plugin(_NullPlugin(), plugin_name)
    LocalNullConnector.instances.clear()
    try:
        afd = {"connector": NULL_CONNECTOR, "host": "127.0.0.1", "port": free_port_block(8), "role": "attention"}
        progress("starting an in-process vLLM engine (attention role)")
        llm = LLM(**plan_engine_kwargs(model_dir, afd, max(requests), tokens_per_request, contexts, DECODE_TOKENS))
        forwards: list[Forward] = []
        llm.apply_model(lambda model: hook_forwards(model, forwards))
        null = _the_connector()
        vocab = int(read_hf_config(model_dir)["vocab_size"])
        g = torch.Generator().manual_seed(0)
        greedy = {"temperature": 0.0, "detokenize": False, "ignore_eos": True}
        prefill, decode_one = SamplingParams(max_tokens=1, **greedy), SamplingParams(max_tokens=DECODE_TOKENS, **greedy)

        def run(r: int, length: int, params: Any) -> list[Forward]:
            prompts = [{"prompt_token_ids": torch.randint(1, vocab, (length,), generator=g).tolist()} for _ in range(r)]
            forwards.clear()
            llm.generate(prompts, params, use_tqdm=False)
            return list(forwards)

        progress("attention per layer, prefill and decode, in turns")
        samples: dict[str, list[float]] = {}
        modes = [("prefill", r, tokens_per_request) for r in requests] + [
            ("decode", r, c) for c in contexts for r in requests
        ]
        for rnd in range(repeat + 1):  # round 0 warms every shape up
            for kind, r, length in modes[rnd % len(modes) :] + modes[: rnd % len(modes)]:
                got = run(r, length, prefill if kind == "prefill" else decode_one)
                if rnd == 0:
                    continue
                # the first forward is the prompt's prefill; a decode run's later ones are its decode steps
                if kind == "prefill":
                    samples.setdefault(f"attention:{r * length}", []).append(got[0].us)
                else:
                    samples.setdefault(f"decode:{length}:{r}", []).extend(f.us for f in got[1:])
        # the hidden states sent: a prefill of the largest batch, and decode steps of every batch (one row each)
        null.captured = []
        run(max(requests), tokens_per_request, prefill)
        prefill_rows = _per_layer(null.captured, layers)
        decode_rows: list[list[torch.Tensor]] = []
        for c in contexts:
            for r in requests:
                null.captured = []
                run(r, c, SamplingParams(max_tokens=2, **greedy))  # the prefill's sends, then one decode step's
                decode_rows.append(_per_layer(null.captured[layers:], layers))
        null.captured = None
        progress("vLLM's FFN role per layer")
        role = open_ffn_role(model_dir, {**afd, "role": "ffn", "port": free_port_block(8)}, rank=0)
        moe = FFNModes(role.ffn, list(range(layers)), 0)
        ffn_modes: dict[str, Callable[[], None]] = {}
        for n in sorted({r * tokens_per_request * k for r in requests for k in range(1, max_group + 1)}):
            ffn_modes[f"ffn:{n}"] = moe.mode(prefill_rows, [], n)
        if contexts:
            rows = [torch.cat([d[i] for d in decode_rows]) for i in range(layers)]
            for n in sorted({r * k for r in requests for k in range(1, max_group + 1)}):
                ffn_modes[f"decode_ffn:{n}"] = moe.mode(rows, [], n)
        from afd_sdk.bench.pipeline_bench import interleaved_medians

        ffn_medians = {k: v * 1e6 / layers for k, v in interleaved_medians(ffn_modes, repeat).items()}
    finally:
        pm.unregister_plugin(plugin_name)
    medians = {k: statistics.median(v) / layers for k, v in samples.items()}
    medians.update(ffn_medians)

    def curve(prefix: str) -> Curve:
        pts = sorted((float(k.split(":")[1]), v) for k, v in medians.items() if k.startswith(prefix))
        return Curve(tuple(pts))

    decode = {c: Curve(tuple((float(r), medians[f"decode:{c}:{r}"]) for r in requests)) for c in contexts}
    return VllmCurves(
        attention_us=curve("attention:"),
        ffn_us=curve("ffn:"),
        decode_us=decode,
        decode_ffn_us=curve("decode_ffn:") if contexts else None,
    )


class Forward(NamedTuple):
    """One forward of vLLM's model: its tokens, and when it started and ended (``perf_counter_ns``)."""

    tokens: int
    start_ns: int
    end_ns: int

    @property
    def us(self) -> float:
        return (self.end_ns - self.start_ns) / 1e3


def hook_forwards(model: torch.nn.Module, forwards: list[Forward]) -> None:
    """Record every forward of vLLM's model into ``forwards`` (a hook per forward: two clock reads)."""
    started: list[int] = []

    def pre(_mod: Any, args: Any, kwargs: Any) -> None:
        started.append(time.perf_counter_ns())

    def post(_mod: Any, args: Any, kwargs: Any, _out: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        n = int(ids.shape[0]) if ids is not None else int(positions.shape[-1])
        forwards.append(Forward(n, started.pop(), time.perf_counter_ns()))

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)


def plan_engine_kwargs(
    model_dir: str,
    afd: Mapping[str, Any] | None,
    requests: int,
    tokens_per_request: int,
    contexts: Sequence[int],
    decode_steps: int,
) -> dict[str, Any]:
    """``vllm.LLM`` arguments of every plan measurement (calibration and validation alike): up to ``requests``
    prompts of ``tokens_per_request`` tokens, or of each of ``contexts`` plus ``decode_steps``, prefilled in one
    engine step, no prefix cache (every prompt computed), seeded."""
    from afd_sdk.integrations.vllm.ffn import engine_kwargs

    longest = max([tokens_per_request, *[c + decode_steps + 1 for c in contexts]])
    batched = max(requests * tokens_per_request, requests * max(contexts, default=0), 256)
    return engine_kwargs(
        model_dir,
        afd,
        max_model_len=longest + 8,
        max_num_batched_tokens=batched,
        max_num_seqs=max(requests, 8),
        enable_prefix_caching=False,
        seed=0,
    )


def _the_connector() -> LocalNullConnector:
    if len(LocalNullConnector.instances) != 1:
        raise ConnectorError(
            f"the vLLM engine built {len(LocalNullConnector.instances)} {NULL_CONNECTOR} connectors; expected one "
            "(an in-process engine, VLLM_ENABLE_V1_MULTIPROCESSING=0, of one attention rank)"
        )
    return LocalNullConnector.instances[0]


def _per_layer(captured: list[torch.Tensor] | None, layers: int) -> list[torch.Tensor]:
    """The first forward's hidden states in ``captured``, one tensor per layer."""
    if not captured or len(captured) < layers:
        raise ConnectorError(
            f"the vLLM attention model sent {len(captured or [])} hidden-state tensors; expected one per layer "
            f"({layers}) per forward"
        )
    return captured[:layers]
