"""``AttentionRunner``: greedy generation on the Attention-role model, with micro-batching.

Each step, the requests are split into ``num_stages`` contiguous stages. The
runner announces the step through the control plane, installs one
``ForwardMetadata`` per stage through the metadata provider, and runs the
stages' forwards. With two or more stages, each stage runs in its own thread
and a *baton* decides who computes: a stage holds it while it computes and
yields it exactly while it waits for its FFN result (as vLLM's dual-batch
overlap does), so stage s+1's attention overlaps stage s's FFN without two
stages competing for cores. A stage with no requests still performs
zero-token exchanges so every FFN peer stays in lockstep.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from afd_sdk.runtime.session import RoleSession

from afd_sdk._compat import moved_names
from afd_sdk.connector import AFDConnector, ConnectorBase
from afd_sdk.errors import AFDConfigError, ConnectorError
from afd_sdk.metadata import ForwardMetadata, MetadataProvider
from afd_sdk.metrics import AFDMetrics
from afd_sdk.runtime.stats import payload_bytes
from afd_sdk.topology import even_blocks
from afd_sdk.wire import A2FPayload, ControlPayload, TransferMetadata, dtype_from_name

__all__ = [
    "AttentionRunner",
    "GenerateResult",
    "RunnerConnector",
    "announce_step",
    "cache_kwarg",
    "cache_of",
]


def cache_kwarg(model: torch.nn.Module) -> str:
    """The KV-cache argument of ``model.forward``: ``cache`` (transformers ≥ 5.2x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_of(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _split_stages_deprecated() -> Any:
    def split_stages(num_requests: int, num_stages: int) -> list[range]:
        """Deprecated: ``[range(a, b) for a, b in afd_sdk.topology.even_blocks(num_requests, num_stages)]``."""
        return [range(a, b) for a, b in even_blocks(num_requests, num_stages)]

    return split_stages


__getattr__ = moved_names(__name__, {"split_stages": ("afd_sdk.topology.even_blocks", _split_stages_deprecated)})


@dataclass
class GenerateResult:
    """Generated token ids per prompt, last-position logits per step, timings."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]  # per step: [num_prompts, vocab]
    step_s: list[float] = field(default_factory=list)
    exchange_us: list[float] = field(default_factory=list)


class _Baton:
    """Exclusive right to compute; handed over at communication points."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def take(self) -> None:
        self._lock.acquire()

    def give(self) -> None:
        self._lock.release()


class RunnerConnector:
    """What the FFN proxies see as ``metadata.connector`` during a step.

    Forwards the data path to the real connector; yields the baton while
    waiting for an FFN result and records exchange latency when asked (into
    ``record`` in µs, and into ``metrics`` for ``/metrics``). Lifecycle calls
    are not forwarded: model code never opens or closes it.
    """

    def __init__(
        self, inner: AFDConnector, baton: _Baton | None, record: list[float] | None, metrics: AFDMetrics | None = None
    ) -> None:
        self.inner = inner
        self.baton = baton
        self.record = record
        self.metrics = metrics
        self._timed = record is not None or metrics is not None
        self._sent_at: dict[int, int] = {}
        self._sent_bytes: dict[int, int] = {}

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
        **routing: torch.Tensor,
    ) -> None:
        if self._timed:
            self._sent_at[metadata.stage_idx] = time.perf_counter_ns()
            if self.metrics is not None:
                sent = payload_bytes(hidden_states, extras)
                for t in routing.values():
                    sent += t.nbytes
                self._sent_bytes[metadata.stage_idx] = sent
        self.inner.send_attn_output(hidden_states, metadata, extras=extras, **routing)

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        baton = self.baton
        if baton is not None:
            baton.give()
        try:
            out = self.inner.recv_ffn_output(ref_tensor, stage_idx)
        except Exception as exc:
            if self.metrics is not None:  # the exchange ended the world: vLLM's engine has no other place to say so
                self.metrics.record_failure(exc)
            raise
        finally:
            if baton is not None:
                baton.take()
        if self._timed:
            ns = time.perf_counter_ns() - self._sent_at.pop(stage_idx)
            if self.record is not None:
                self.record.append(ns / 1000)
            if self.metrics is not None:
                self.metrics.observe_exchange(stage_idx, ns * 1e-9, self._sent_bytes.pop(stage_idx), out.nbytes)
        return out

    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        raise ConnectorError("recv_attn_output() is an ffn-side call")

    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        raise ConnectorError("send_ffn_output() is an ffn-side call")


@dataclass
class _Stage:
    idx: int
    requests: range
    input_ids: torch.Tensor | None = None  # [B, T] for the next forward
    cache: Any = None
    logits: torch.Tensor | None = None
    use_cache: bool = True


def announce_step(connector: ConnectorBase, payload: ControlPayload) -> None:
    """Attention side: announce one step on the connector's control plane and apply it locally.

    Called once per step before layer 0 by the runner, the benchmarks and the
    conformance workers. A routed-dispatch connector has no control plane
    (routing travels in-band) and is left alone; a point-to-point connector
    without one is a ``ConnectorError``: its FFN side could not know the step.
    """
    if not connector.requires_control_plane and connector.control_plane is None:
        return
    cp = connector.require_control_plane()
    cp.send(payload)
    cp.apply(payload)


class AttentionRunner:
    """Runs the Attention-role model of one attention rank.

    ``model`` is the native transformers model whose FFN modules are proxies
    (``afd_sdk.proxy``, placed by a binding); ``connector`` is initialised by the caller.
    """

    @classmethod
    def for_session(
        cls, session: RoleSession, *, record_exchanges: bool = False, metrics: AFDMetrics | None = None
    ) -> AttentionRunner:
        """The runner of an opened Attention-role session (its model, connector, provider, shape and stages)."""
        return cls(
            session.model,
            session.connector,
            session.provider,
            num_layers=session.num_layers,
            hidden_size=session.hidden_size,
            num_stages=session.config.num_stages,
            record_exchanges=record_exchanges,
            metrics=metrics,
        )

    def __init__(
        self,
        model: torch.nn.Module,
        connector: AFDConnector,
        provider: MetadataProvider,
        *,
        num_layers: int,
        hidden_size: int,
        num_stages: int = 1,
        record_exchanges: bool = False,
        metrics: AFDMetrics | None = None,
    ) -> None:
        self.model = model
        #: where each exchange and step is recorded for ``/metrics``; ``None``: not recorded
        self.metrics = metrics
        self.connector = connector
        self.provider = provider
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.num_stages = num_stages
        self.exchanges: list[float] | None = [] if record_exchanges else None
        self._dtype = next(model.parameters()).dtype
        self._cache_kw = cache_kwarg(model)
        # zero-token extras for empty stages: fixed for the run
        specs = connector.context.ffn_extras
        self._no_extras = (
            {e.name: torch.empty(0, *e.trailing_shape, dtype=dtype_from_name(e.dtype)) for e in specs}
            if specs
            else None
        )
        # async-dispatch connectors exchange on MoE layers only, with routing (empty for an empty stage)
        moe = connector.context.moe if connector.capabilities.async_dispatch else None
        self._exchange_layers: tuple[int, ...] | range = moe.moe_layers if moe is not None else range(num_layers)
        self._empty_routing: dict[str, torch.Tensor] = (
            {"topk_ids": torch.empty(0, moe.top_k, dtype=torch.long), "topk_weights": torch.empty(0, moe.top_k)}
            if moe is not None
            else {}
        )

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        on_step: Callable[[int, int], None] | None = None,
    ) -> GenerateResult:
        """Greedy-decode ``max_new_tokens`` tokens for every prompt.

        Prompts in one stage must have equal length (the reference runtime
        does not pad). ``on_step(step, total)`` reports progress.
        """
        if not prompts or max_new_tokens < 1:
            raise AFDConfigError("generate() needs at least one prompt and max_new_tokens >= 1", key="prompts")
        stages = [
            _Stage(s, r) for s, r in enumerate(range(a, b) for a, b in even_blocks(len(prompts), self.num_stages))
        ]
        for st in stages:
            if st.requests:
                lengths = {len(prompts[i]) for i in st.requests}
                if len(lengths) != 1 or 0 in lengths:
                    raise AFDConfigError(
                        f"prompts {list(st.requests)} of stage {st.idx} have lengths {sorted(lengths)}; the reference "
                        "runtime needs equal, non-zero lengths within a stage (it does not pad)",
                        key="prompts",
                    )
                st.input_ids = torch.tensor([prompts[i] for i in st.requests], dtype=torch.long)
        result = GenerateResult([[] for _ in prompts], [])
        with torch.inference_mode():
            for step in range(max_new_tokens):
                t0 = time.perf_counter()
                counts = [0 if st.input_ids is None else st.input_ids.numel() for st in stages]
                announce_step(
                    self.connector, ControlPayload(step, tuple((c,) for c in counts), max(counts), self.num_layers)
                )
                self._run_step(stages, counts, step)
                if self.metrics is not None:
                    self.metrics.observe_step(sum(counts))
                step_logits = torch.cat([st.logits for st in stages if st.logits is not None])
                result.logits.append(step_logits)
                for st in stages:
                    if st.logits is None:
                        continue
                    nxt = st.logits.argmax(dim=-1)
                    for j, req in enumerate(st.requests):
                        result.tokens[req].append(int(nxt[j]))
                    st.input_ids = nxt[:, None]
                result.step_s.append(time.perf_counter() - t0)
                if on_step is not None:
                    on_step(step + 1, max_new_tokens)
        if self.exchanges is not None:
            result.exchange_us = list(self.exchanges)
        return result

    def step(self, input_ids: torch.Tensor, step_idx: int = 0) -> torch.Tensor:
        """One forward of ``[B, T]`` token ids without KV cache, split into stages by row.

        Announces the step, runs it like ``generate`` does and returns the
        last-position logits ``[B, vocab]``. Used by benchmarks and warm-ups.
        """
        stages = [
            _Stage(s, range(a, b), use_cache=False)
            for s, (a, b) in enumerate(even_blocks(input_ids.shape[0], self.num_stages))
        ]
        for st in stages:
            st.input_ids = input_ids[st.requests.start : st.requests.stop] if st.requests else None
        counts = [0 if st.input_ids is None else st.input_ids.numel() for st in stages]
        with torch.inference_mode():
            announce_step(
                self.connector, ControlPayload(step_idx, tuple((c,) for c in counts), max(counts), self.num_layers)
            )
            self._run_step(stages, counts, step_idx)
        if self.metrics is not None:
            self.metrics.observe_step(sum(counts))
        return torch.cat([st.logits for st in stages if st.logits is not None])

    # --- one step ----------------------------------------------------------------

    def _metadata(self, stage: int, counts: list[int], stages: list[_Stage], conn: Any, step: int) -> ForwardMetadata:
        starts = tuple(sum(counts[:s]) for s in range(len(counts)))
        return ForwardMetadata(
            stage_idx=stage,
            num_stages=len(counts),
            stage_token_start=starts,
            stage_token_len=tuple(counts),
            stage_token_len_padded=tuple(counts),
            request_start=tuple(st.requests.start for st in stages),
            connector=conn,
            transaction_id=step,
        )

    def _run_step(self, stages: list[_Stage], counts: list[int], step: int) -> None:
        if len(stages) == 1:
            timed = self.exchanges is not None or self.metrics is not None
            conn: Any = RunnerConnector(self.connector, None, self.exchanges, self.metrics) if timed else self.connector
            self._forward(stages[0], self._metadata(0, counts, stages, conn, step))
            return
        baton = _Baton()
        conn = RunnerConnector(self.connector, baton, self.exchanges, self.metrics)
        errors: list[BaseException] = []

        def run(st: _Stage) -> None:
            baton.take()
            try:
                with torch.inference_mode():  # grad mode is thread-local: enter it in every stage thread
                    self._forward(st, self._metadata(st.idx, counts, stages, conn, step))
            except BaseException as exc:  # re-raised in the caller's thread below
                errors.append(exc)
            finally:
                baton.give()

        threads = [threading.Thread(target=run, args=(st,), name=f"afd-stage{st.idx}") for st in stages]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.connector.config.timeout_s * (self.num_layers + 2)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            raise ConnectorError(f"step {step}: a stage thread did not finish before its deadline")
        if errors:
            raise errors[0]

    def _forward(self, st: _Stage, md: ForwardMetadata) -> None:
        with self.provider.install(md):
            if st.input_ids is None:
                self._empty_stage(md)
                st.logits = None
                return
            if st.use_cache:
                out = self.model(input_ids=st.input_ids, use_cache=True, **{self._cache_kw: st.cache})
                st.cache = cache_of(out)
            else:
                out = self.model(input_ids=st.input_ids, use_cache=False)
            st.logits = out.logits[:, -1, :].float()

    def _empty_stage(self, md: ForwardMetadata) -> None:
        """Zero-token exchanges for every exchanging layer, keeping the FFN side in lockstep."""
        empty = torch.empty(0, self.hidden_size, dtype=self._dtype)
        for layer in self._exchange_layers:
            md.connector.send_attn_output(
                empty, TransferMetadata(layer, md.stage_idx, (0,)), extras=self._no_extras, **self._empty_routing
            )
            md.connector.recv_ffn_output(empty, md.stage_idx)
