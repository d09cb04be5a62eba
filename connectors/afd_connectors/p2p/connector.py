"""``P2pNcclAFDConnector`` (alias ``p2p``): torch.distributed point-to-point.

One code path for both backends: the tensors' device picks it — NCCL for CUDA,
Gloo for CPU. The world is the FFN-first world of :mod:`afd_sdk.topology`
(any A ≥ F; blocks as even as possible). Process groups are built directly on a
``TCPStore`` at ``port + F`` (hosted by FFN rank 0), one group per micro-batch
stage so concurrent stage threads never share a communicator, and the default
process group — which vLLM owns — is never touched.

P2P carries no headers: shapes come from the step's
:class:`~afd_sdk.wire.ControlPayload` (``ZmqControlPlane``), which the runtime
sends before layer 0. FFN receives each peer's tokens straight into their slice
of one preallocated buffer, so fan-in costs no extra copy. The attention side
posts the receive of the FFN output with its send, into one of two buffers per
stage that alternate.

The process-group calls go through a wire (:mod:`afd_connectors.p2p.wire`,
``connector_extra_config.wire``): the native one (C++ against c10d) also runs
the attention side's steady state, its checks reading the tensor's fields
directly; with the Python wire the steady state's checks are memoised per
(metadata, shape, dtype, device), as ``zmq`` does. Either way the step's
announced count and a pending send are checked per call.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import msgspec
import torch

from afd_connectors import native
from afd_connectors.p2p.wire import make_wire, native_wire_problem
from afd_sdk.config import AFDConfig
from afd_sdk.connector import AFDConnector, ConnectorCapabilities, ConnectorContext
from afd_sdk.control import (
    DeviceBuffers,
    PlanCache,
    ZmqControlPlane,
    check_store_port,
    open_tcp_store,
    shutdown_groups,
    stage_groups,
    work_failed,
)
from afd_sdk.errors import AFDConfigError, ConnectorError
from afd_sdk.topology import FFNFirstWorld
from afd_sdk.wire import COMMON_DTYPES, A2FPayload, TransferMetadata, dtype_from_name

logger = logging.getLogger(__name__)

__all__ = ["P2pExtraConfig", "P2pNcclAFDConnector"]

#: entries per memoised-check map before it is cleared (token counts vary while serving)


class P2pExtraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``connector_extra_config`` of ``P2pNcclAFDConnector``.

    * ``backend``: ``"auto"`` (default: NCCL when the context device is CUDA,
      else Gloo), ``"nccl"`` or ``"gloo"``.
    * ``store_port``: port of the TCPStore hosted by FFN rank 0 (default
      ``afd.port + num_ffn_ranks``).
    * ``wire``: who makes the process-group calls: ``"native"`` (C++,
      :mod:`afd_connectors.p2p._p2pwire`, with the attention side's steady state),
      ``"python"``, or ``"auto"`` (default: native where it is built). The
      messages are the same.
    """

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    store_port: int | None = None
    wire: Literal["auto", "native", "python"] = "auto"


@dataclass
class _RecvPlan:
    """The FFN side's receives for one stage and one set of per-peer token counts (see ``_recv_plan``)."""

    counts: tuple[int, ...]
    #: the receive buffers: hidden states, then the extras, each ``[sum(counts), ...]``
    tensors: list[torch.Tensor]
    #: ``(tensor or row slice, peer global rank)`` per posted receive
    posts: tuple[tuple[torch.Tensor, int], ...]
    extras: dict[str, torch.Tensor]
    #: the payload handed out per layer, built on first use
    payloads: dict[int, A2FPayload]


class P2pNcclAFDConnector(AFDConnector):
    """torch.distributed P2P connector (NCCL on CUDA, Gloo on CPU)."""

    name = "P2pNcclAFDConnector"
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        world_layout="ffn_first",
        attention_lt_ffn=False,
        supports_extras=True,
        dtypes=COMMON_DTYPES,
    )
    extra_config_schema = P2pExtraConfig
    #: ``afd bench connector --raw posted``: this connector's order of process-group calls, without its contract
    raw_baselines: ClassVar[Mapping[str, str | None]] = {"gloo": None, "posted": "afd_connectors.p2p.raw:RawGlooPosted"}

    @classmethod
    def native_modules(cls) -> Mapping[str, str | None]:
        return native.problems("p2p._p2pwire")

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.device = torch.device(context.device)
        self.backend = self._pick_backend()
        self._store: Any = None
        self._groups: list[Any] = []
        self._bufs = DeviceBuffers()
        #: the process-group calls and what is in flight per stage (afd_connectors.p2p.wire; set in open())
        self._wire: Any = None
        #: "native" or "python": who makes the process-group calls (set in open())
        self.wire_name = ""
        self._fast_send: Any = None  # the native wire's attn_send (see open())
        self._fast_recv: Any = None  # the native wire's attn_recv (see open())
        self._plans: dict[int, _RecvPlan] = {}  # stage -> its receives while the token counts repeat
        self._layer: dict[int, int] = {}
        self._step_of: dict[int, object] = {}  # stage -> the control payload its layer counter belongs to
        #: the Python wire's steady state, memoised checks (cleared at PLAN_CACHE_LIMIT entries), by (metadata, shape,
        #: dtype, get_device()) of a valid send: attention (the step's counts for the stage, send record, the two
        #: output buffers); ffn with one peer (peer), with either wire
        self._send_plans: PlanCache[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, int], Any, Any]] = PlanCache()
        self._f2a_plans: PlanCache[tuple[Any, ...], int] = PlanCache()
        self._hidden = context.model.hidden_size
        self._dtype = dtype_from_name(context.model.dtype)
        self._extras = context.ffn_extras
        #: (name, trailing shape, dtype) of every tensor received per layer: hidden states, then extras
        self._specs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = (
            ("hidden_states", (self._hidden,), self._dtype),
            *((e.name, tuple(e.trailing_shape), dtype_from_name(e.dtype)) for e in self._extras),
        )
        self._peers: tuple[int, ...] = ()

    def _pick_backend(self) -> str:
        want = self.extra.backend
        if want == "auto":
            want = "nccl" if self.device.type == "cuda" else "gloo"
        if (want == "nccl") != (self.device.type == "cuda"):
            raise AFDConfigError(
                f"afd.connector_extra_config.backend={self.extra.backend!r} does not fit device {self.device}; "
                "expected 'nccl' with CUDA tensors, 'gloo' with CPU tensors, or 'auto'",
                key="afd.connector_extra_config.backend",
                value=self.extra.backend,
            )
        return want

    @classmethod
    def validate_config(cls, config: AFDConfig) -> None:
        super().validate_config(config)
        check_store_port(config.port, config.connector_extra_config.get("store_port"), config.num_ffn_ranks)
        if config.ffn_replicas > 1 and (
            config.num_ffn_ranks > 1 or config.connector_extra_config.get("store_port") is not None
        ):
            # one process group spans the world: an attention rank failing over alone cannot form the next
            # replica's group when other FFN ranks stay on theirs, and a fixed store port would be every replica's
            raise AFDConfigError(
                f"afd.ffn_replicas={config.ffn_replicas} with {cls.name} needs afd.num_ffn_ranks=1 and no "
                f"connector_extra_config.store_port (got num_ffn_ranks={config.num_ffn_ranks}, store_port="
                f"{config.connector_extra_config.get('store_port')}); expected both, or the zmq or shm connector",
                key="afd.ffn_replicas",
                value=config.ffn_replicas,
            )
        wire = config.connector_extra_config.get("wire", "auto")  # type: ignore[attr-defined]
        problem = native_wire_problem() if wire == "native" else None
        if problem is not None:
            raise AFDConfigError(
                f"afd.connector_extra_config.wire='native' cannot run here ({problem}); expected afd-sdk installed "
                "with torch importable at build time (pip install --no-build-isolation, as scripts/bootstrap.sh "
                "does), or wire 'auto' or 'python'",
                key="afd.connector_extra_config.wire",
                value=wire,
            )

    # --- lifecycle ----------------------------------------------------------

    def open(self) -> None:
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ConnectorError(f"{self.name} backend 'nccl' needs CUDA, and torch.cuda.is_available() is False")
        cfg = self.config
        # handshake first: a mismatched peer fails before any process group exists
        self.attach_control_plane(ZmqControlPlane(self.context, connector_name=self.name))
        world = self.world
        assert isinstance(world, FFNFirstWorld)
        rank = world.global_rank(self.role, self.role_rank)
        if self.role == "ffn":
            self._peers = tuple(world.global_rank("attention", a) for a in world.attention_for_ffn(self.role_rank))
        else:
            self._peers = (world.global_rank("ffn", world.ffn_for_attention(self.role_rank)),)
        store_port = self.extra.store_port or cfg.port + cfg.num_ffn_ranks
        # the handshake above met every peer: the store's rendezvous needs only the exchange deadline. Its master
        # is world rank 0, FFN rank 0: at its own address (afd.ffn_hosts[0] where the pool spans hosts)
        master = cfg.ffn_host(0)
        self._store = open_tcp_store(master, store_port, world.world_size, rank == 0, cfg.timeout_s, self.name)
        self._groups = stage_groups(
            self._store,
            f"afd/{cfg.port}",
            rank,
            world.world_size,
            self.backend,
            cfg.timeout_s,
            cfg.num_stages,
            host=master,
            port=cfg.port,
            interface=cfg.interface,
        )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._wire = make_wire(
            self.extra.wire,
            self._groups,
            self._peers,
            cfg.timeout_s,
            dtype=self._dtype,
            device=self.device,
            hidden=self._hidden,
            control=self._control,
            sent=self.sends,
        )
        self.wire_name = self._wire.name
        # the native wire's attention steady state checks no extras: a model that declares them sends through the
        # Python path, whose memoised checks also exist only without extras
        native = self.wire_name == "native"
        self._fast_send = self._wire.attn_send if native and not self._extras else None
        self._fast_recv = self._wire.attn_recv if native else None

    def release(self) -> None:
        groups, self._groups = self._groups, []
        shutdown_groups(groups, self.name)
        wire, self._wire = self._wire, None
        self._fast_send = self._fast_recv = None
        if wire is not None:
            wire.clear()
        self._store = None
        self._bufs.clear()
        self._plans.clear()
        self._layer.clear()
        self._step_of.clear()
        self._send_plans.clear()
        self._f2a_plans.clear()

    # --- helpers --------------------------------------------------------------

    def _step_counts(self, stage_idx: int) -> tuple[int, ...]:
        control = self.control_plane
        payload = control.current if control is not None else None
        if payload is None:
            raise ConnectorError(
                f"{self.name} needs the step's ControlPayload before data moves: the attention runner sends it and "
                "both sides apply() it first"
            )
        if not 0 <= stage_idx < payload.num_stages:
            raise ConnectorError(f"stage_idx={stage_idx} but the step announced {payload.num_stages} stages")
        if self._step_of.get(stage_idx) is not payload:
            self._step_of[stage_idx] = payload
            # Gloo carries no header: the layer is counted from the step's first (a failover's replayed step
            # starts where the attention rank resumes it)
            self._layer[stage_idx] = payload.resume_layers[stage_idx] if payload.resume_layers else 0
        return payload.stage_token_counts[stage_idx]

    def _failed(self, exc: RuntimeError, what: str, *what_args: object) -> Exception:
        """The ``PeerLostError`` for a wait that raised ``exc``, naming what it waited for."""
        return work_failed(exc, self.config.timeout_s, what, *what_args)

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        # the steady state, native: the wire checks what the Python below checks and sends, or declines (set only
        # for a model that declares no extras)
        fast = self._fast_send
        if fast is not None and extras is None and fast(hidden_states, metadata):
            return
        wire = self._wire
        # the steady state, Python wire: every check below depends only on (metadata, shape, dtype, device) and
        # on state fixed for the session, except the step's announced count, checked per call (a plan exists only
        # for an initialised attention side whose model declares no extras); per call also: no send pending
        key = (metadata, hidden_states.shape, hidden_states.dtype, hidden_states.get_device())
        plan = self._send_plans.get(key)
        if plan is not None and extras is None:
            stage = metadata.stage_idx
            counts, sent, out0, out1 = plan
            step = self._control.current if self._control is not None else None
            announced = step.stage_token_counts if step is not None else ()
            if stage < len(announced) and announced[stage] == counts and stage not in self.sends:
                if sent[1]:
                    wire.attn_post(stage, (hidden_states.contiguous(),), out0, out1)
                self.sends[stage] = sent
                return
        self.require_role("attention", "send_attn_output")
        self.check_stage(metadata.stage_idx)
        (announced,) = self._step_counts(metadata.stage_idx)
        n = self.check_attn_send(hidden_states, metadata)
        if n != announced:
            raise ConnectorError(f"{n} tokens sent for stage {metadata.stage_idx}; the step announced {announced}")
        if hidden_states.dtype != self._dtype or hidden_states.device != self.device:
            raise ConnectorError(
                f"hidden_states is {hidden_states.dtype} on {hidden_states.device}; "
                f"expected {self._dtype} on {self.device}"
            )
        self.check_no_send_pending(metadata.stage_idx)
        tensors = [hidden_states, *self.check_extras(extras, n)] if self._extras else [hidden_states]
        stage = metadata.stage_idx
        # the stage's two output buffers, alternating: the tensor the previous recv_ffn_output returned stays
        # valid until the next one, as the contract says, while the next receive is already posted
        out0, out1 = (self._bufs.get(("f2a", stage, i), n, (self._hidden,), self._dtype, self.device) for i in (0, 1))
        if n:
            # completed in recv_ffn_output: a blocking send could deadlock against interleaved stages. The receive
            # of the FFN output is posted right behind the send, as the raw ``posted`` loop does: the reply can
            # land as soon as it arrives, also while the runner still sends its other stages
            wire.attn_post(stage, [t.contiguous() for t in tensors], out0, out1)
        self.record_send(metadata, n)
        if not self._extras:
            self._send_plans.remember(key, ((n,), self.sends[stage], out0, out1))

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        wire = self._wire
        fast = self._fast_recv
        if fast is not None:  # the native steady state: the output, or None having changed nothing
            try:
                out = fast(ref_tensor, stage_idx)
            except RuntimeError as exc:
                layer = wire.last_layer(stage_idx)
                raise self._failed(exc, "ffn output of layer %d, stage %d", layer, stage_idx) from exc
            if out is not None:
                return out
        self.require_role("attention", "recv_ffn_output")
        self.check_stage(stage_idx)
        sent = self.sends.get(stage_idx)
        if sent is not None and (
            ref_tensor.shape != (sent[1], self._hidden)
            or ref_tensor.dtype != self._dtype
            or ref_tensor.device != self.device
        ):
            # refused before the send record is taken: a call with the right ref_tensor still gets the output
            raise ConnectorError(
                f"ref_tensor is {ref_tensor.dtype}{list(ref_tensor.shape)} on {ref_tensor.device}; "
                f"expected {self._dtype}[{sent[1]}, {self._hidden}] on {self.device}, the "
                "model's dtype in which the FFN output arrives"
            )
        layer, n = self.take_send(stage_idx)
        if not n:
            return self._bufs.get(("f2a", stage_idx, 0), 0, (self._hidden,), self._dtype, self.device)
        try:
            return wire.attn_finish(stage_idx)
        except RuntimeError as exc:
            raise self._failed(exc, "ffn output of layer %d, stage %d", layer, stage_idx) from exc

    # --- ffn side -------------------------------------------------------------

    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        plan = self._plans.get(stage_idx)
        step = self._control.current if self._control is not None else None
        if plan is None or step is None or self._step_of.get(stage_idx) is not step:
            # not the steady state (a later layer of a step whose counts this stage's plan was checked against;
            # plans exist only on an initialised ffn side, for a valid stage)
            self.require_role("ffn", "recv_attn_output")
            self.check_stage(stage_idx)
            plan = self._recv_plan(stage_idx, self._step_counts(stage_idx))
        layer = self._layer[stage_idx]
        self._layer[stage_idx] = layer + 1
        try:  # completes the stage's previous output send first: the plan's buffers may be what it reads
            self._wire.ffn_wait_plan(stage_idx)
        except RuntimeError as exc:
            raise self._failed(
                exc, "hidden states of layer %d, stage %d (or the previous output's send)", layer, stage_idx
            ) from exc
        got = plan.payloads.get(layer)
        if got is None:  # once per layer while the step's token counts repeat
            got = plan.payloads[layer] = A2FPayload(
                plan.tensors[0], TransferMetadata(layer, stage_idx, plan.counts), plan.extras
            )
        return got

    def _recv_plan(self, stage_idx: int, counts: tuple[int, ...]) -> _RecvPlan:
        """The receives of ``stage_idx`` for the peers' token ``counts``: built when the counts change, reused by
        every layer (and every step) while they repeat, so a receive makes no tensor, slice or payload object."""
        plan = self._plans.get(stage_idx)
        if plan is not None and (plan.counts is counts or plan.counts == counts):
            return plan
        if len(counts) != len(self._peers):
            raise ConnectorError(
                f"control payload has {len(counts)} token counts; this rank has {len(self._peers)} peers"
            )
        total = sum(counts)
        tensors = [
            self._bufs.get(("a2f", stage_idx, i), total, shape, dt, self.device)
            for i, (_, shape, dt) in enumerate(self._specs)
        ]
        posts = []
        start = 0
        for peer, n in zip(self._peers, counts, strict=True):
            if n:  # a peer with every row (one peer, always) receives into the whole buffer: no slice
                posts += [(t if n == total else t[start : start + n], peer) for t in tensors]
            start += n
        extras = {name: t for (name, _, _), t in zip(self._specs[1:], tensors[1:], strict=True)}
        plan = self._plans[stage_idx] = _RecvPlan(tuple(counts), tensors, tuple(posts), extras, {})
        self._wire.ffn_plan(stage_idx, plan.posts)
        return plan

    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        # one peer, the steady state: the checks below depend only on (metadata, shape, dtype, device) and on
        # state fixed for the session (a plan exists only on an initialised ffn side with one peer)
        key = (metadata, output.shape, output.dtype, output.get_device())
        peer = self._f2a_plans.get(key)
        if peer is not None:
            if metadata.seq_lens[0]:
                self._wire.ffn_send_one(metadata.stage_idx, output.contiguous(), peer)
            return
        self.require_role("ffn", "send_ffn_output")
        self.check_stage(metadata.stage_idx)
        self.check_ffn_send(output, metadata, len(self._peers))
        if len(self._peers) == 1:
            self._f2a_plans.remember(key, self._peers[0])
        output = output.contiguous()
        parts = []
        start = 0
        total = metadata.num_tokens
        for peer, n in zip(self._peers, metadata.seq_lens, strict=True):
            if n:  # a peer with every row (one peer, always) gets the whole tensor: no slice
                parts.append((output if n == total else output[start : start + n], peer))
            start += n
        # completed by the next recv_attn_output of this stage (or close), which keeps `output` alive until then
        self._wire.send(metadata.stage_idx, parts)
