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
stage that alternate. The steady state's checks are memoised per
(metadata, shape, dtype, device), as ``zmq`` does; the step's announced count
and a pending send are checked per call.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import msgspec
import torch

from afd_sdk.config import AFDConfig
from afd_sdk.connector import AFDConnector, ConnectorCapabilities, ConnectorContext
from afd_sdk.control import (
    DeviceBuffers,
    ZmqControlPlane,
    check_store_port,
    open_tcp_store,
    shutdown_groups,
    stage_groups,
    wait_works,
    work_failed,
)
from afd_sdk.errors import AFDConfigError, ConnectorError
from afd_sdk.topology import FFNFirstWorld
from afd_sdk.wire import COMMON_DTYPES, A2FPayload, TransferMetadata, dtype_from_name

logger = logging.getLogger(__name__)

__all__ = ["P2pExtraConfig", "P2pNcclAFDConnector"]

#: entries per memoised-check map before it is cleared (token counts vary while serving)
_MAX_PLANS = 4096


class P2pExtraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``connector_extra_config`` of ``P2pNcclAFDConnector``.

    * ``backend``: ``"auto"`` (default: NCCL when the context device is CUDA,
      else Gloo), ``"nccl"`` or ``"gloo"``.
    * ``store_port``: port of the TCPStore hosted by FFN rank 0 (default
      ``afd.port + num_ffn_ranks``).
    """

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    store_port: int | None = None


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
    raw_baselines: ClassVar[Mapping[str, str]] = {"posted": "afd_connectors.p2p_raw:RawGlooPosted"}

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.device = torch.device(context.device)
        self.backend = self._pick_backend()
        self._store: Any = None
        self._groups: list[Any] = []
        self._bufs = DeviceBuffers()
        # sends still in flight per stage, with the tensors they read (kept alive until done)
        self._inflight: dict[int, tuple[Sequence[Any], Sequence[torch.Tensor]]] = {}
        self._plans: dict[int, _RecvPlan] = {}  # stage -> its receives while the token counts repeat
        self._layer: dict[int, int] = {}
        self._step_of: dict[int, object] = {}  # stage -> the control payload its layer counter belongs to
        #: the steady state's memoised checks (cleared at _MAX_PLANS entries), by (metadata, shape, dtype,
        #: get_device()) of a valid send: attention (group, peer, the step's counts for the stage, send record);
        #: ffn with one peer (group, peer)
        self._send_plans: dict[tuple[Any, ...], tuple[Any, int, tuple[int, ...], tuple[int, int]]] = {}
        self._f2a_plans: dict[tuple[Any, ...], tuple[Any, int]] = {}
        self._timeout: Any = None  # the exchange deadline as the timedelta every wait takes (set in open())
        #: attention side: stage -> the receive of the FFN output, posted with the send, and its buffer
        self._posted: dict[int, tuple[Any, torch.Tensor]] = {}
        #: attention side: stage -> which of its two output buffers the next receive fills
        self._flip: dict[int, int] = {}
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
        # the handshake above met every peer: the store's rendezvous needs only the exchange deadline
        self._store = open_tcp_store(cfg.host, store_port, world.world_size, rank == 0, cfg.timeout_s, self.name)
        self._groups = stage_groups(self._store, f"afd/{cfg.port}", rank, world.world_size, self.backend,
                                    cfg.timeout_s, cfg.num_stages, host=cfg.host, port=cfg.port,
                                    interface=cfg.interface)  # fmt: skip
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._timeout = datetime.timedelta(seconds=cfg.timeout_s)

    def release(self) -> None:
        groups, self._groups = self._groups, []
        shutdown_groups(groups, self.name)
        self._store = None
        self._bufs.clear()
        self._inflight.clear()
        self._plans.clear()
        self._layer.clear()
        self._step_of.clear()
        self._send_plans.clear()
        self._f2a_plans.clear()
        self._posted.clear()
        self._flip.clear()

    # --- helpers --------------------------------------------------------------

    def _group(self, stage_idx: int) -> Any:
        self.check_stage(stage_idx)
        return self._groups[stage_idx]

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
            self._layer[stage_idx] = 0
        return payload.stage_token_counts[stage_idx]

    def _wait(self, works: Sequence[Any], what: str, *what_args: object) -> None:
        wait_works(works, self.config.timeout_s, what, *what_args)

    def _wait_one(self, work: Any, what: str, *what_args: object) -> None:
        """:meth:`_wait` of one work handle, without the call layers (the steady state's waits)."""
        try:
            work.wait(self._timeout)
        except RuntimeError as exc:
            raise work_failed(exc, self.config.timeout_s, what, *what_args) from exc

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        # the steady state: every check below depends only on (metadata, shape, dtype, device) and on state fixed
        # for the session, except the step's announced count, checked per call (a plan exists only for an
        # initialised attention side whose model declares no extras); per call also: no send pending
        key = (metadata, hidden_states.shape, hidden_states.dtype, hidden_states.get_device())
        plan = self._send_plans.get(key)
        if plan is not None and extras is None:
            stage = metadata.stage_idx
            pg, peer, counts, sent = plan
            step = self._control.current if self._control is not None else None
            announced = step.stage_token_counts if step is not None else ()
            if stage < len(announced) and announced[stage] == counts and stage not in self._sent:
                if sent[1]:
                    t = hidden_states.contiguous()
                    self._inflight[stage] = ((pg.send([t], peer, 0),), (t,))
                    self._post_recv(pg, peer, stage, sent[1])
                self._sent[stage] = sent
                return
        self.require_role("attention", "send_attn_output")
        pg = self._group(metadata.stage_idx)
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
        if n:
            # completed in recv_ffn_output: a blocking send could deadlock against interleaved stages
            tensors = [t.contiguous() for t in tensors]
            self._inflight[metadata.stage_idx] = ([pg.send([t], self._peers[0], 0) for t in tensors], tensors)
            self._post_recv(pg, self._peers[0], metadata.stage_idx, n)
        self.record_send(metadata, n)
        if not self._extras:
            if len(self._send_plans) >= _MAX_PLANS:  # token counts change from step to step while serving
                self._send_plans.clear()
            self._send_plans[key] = (pg, self._peers[0], (n,), self._sent[metadata.stage_idx])

    def _post_recv(self, pg: Any, peer: int, stage: int, n: int) -> None:
        """Post the receive of the FFN output for ``n`` tokens right behind the send, as the raw ``posted`` loop does.

        The reply can land as soon as it arrives, also while the runner still sends its other stages. The two
        output buffers of a stage alternate, so the tensor the previous ``recv_ffn_output`` returned stays valid
        until the next one, as the contract says.
        """
        flip = self._flip.get(stage, 0) ^ 1
        self._flip[stage] = flip
        out = self._bufs.get(("f2a", stage, flip), n, (self._hidden,), self._dtype, self.device)
        self._posted[stage] = (pg.recv([out], peer, 0), out)

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        self.require_role("attention", "recv_ffn_output")
        self.check_stage(stage_idx)
        sent = self._sent.get(stage_idx)
        if sent is not None and (ref_tensor.shape != (sent[1], self._hidden) or ref_tensor.dtype != self._dtype
                                 or ref_tensor.device != self.device):  # fmt: skip
            # refused before the send record is taken: a call with the right ref_tensor still gets the output
            raise ConnectorError(f"ref_tensor is {ref_tensor.dtype}{list(ref_tensor.shape)} on {ref_tensor.device}; "
                                 f"expected {self._dtype}[{sent[1]}, {self._hidden}] on {self.device}, the "
                                 "model's dtype in which the FFN output arrives")  # fmt: skip
        layer, n = self.take_send(stage_idx)
        if not n:
            return self._bufs.get(("f2a", stage_idx, 0), 0, (self._hidden,), self._dtype, self.device)
        recv, out = self._posted.pop(stage_idx)
        works, _keepalive = self._inflight.pop(stage_idx, ((), ()))
        for work in works:
            self._wait_one(work, "send of layer %d to ffn rank %d", layer, self._peers[0])
        self._wait_one(recv, "ffn output of layer %d, stage %d", layer, stage_idx)
        return out

    # --- ffn side -------------------------------------------------------------

    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        plan = self._plans.get(stage_idx)
        step = self._control.current if self._control is not None else None
        if plan is not None and step is not None and self._step_of.get(stage_idx) is step:
            # the steady state: a later layer of a step whose counts this stage's plan was checked against (plans
            # exist only on an initialised ffn side, for a valid stage)
            pg = self._groups[stage_idx]
        else:
            self.require_role("ffn", "recv_attn_output")
            pg = self._group(stage_idx)
            plan = self._recv_plan(stage_idx, self._step_counts(stage_idx))
        works, _keepalive = self._inflight.pop(stage_idx, ((), ()))
        for work in works:
            self._wait_one(work, "send of the previous ffn output, stage %d", stage_idx)
        layer = self._layer[stage_idx]
        self._layer[stage_idx] = layer + 1
        if len(plan.posts) == 1:
            t, peer = plan.posts[0]
            self._wait_one(pg.recv([t], peer, 0), "hidden states of layer %d, stage %d", layer, stage_idx)
        else:
            self._wait([pg.recv([t], peer, 0) for t, peer in plan.posts], "hidden states of layer %d, stage %d",
                       layer, stage_idx)  # fmt: skip
        got = plan.payloads.get(layer)
        if got is None:  # once per layer while the step's token counts repeat
            got = plan.payloads[layer] = A2FPayload(plan.tensors[0], TransferMetadata(layer, stage_idx, plan.counts),
                                                    plan.extras)  # fmt: skip
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
        return plan

    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        # one peer, the steady state: the checks below depend only on (metadata, shape, dtype, device) and on
        # state fixed for the session (a plan exists only on an initialised ffn side with one peer)
        key = (metadata, output.shape, output.dtype, output.get_device())
        plan = self._f2a_plans.get(key)
        if plan is not None:
            pg, peer = plan
            output = output.contiguous()
            works = (pg.send([output], peer, 0),) if metadata.seq_lens[0] else ()
            self._inflight[metadata.stage_idx] = (works, (output,))
            return
        self.require_role("ffn", "send_ffn_output")
        pg = self._group(metadata.stage_idx)
        self.check_ffn_send(output, metadata, len(self._peers))
        if len(self._peers) == 1:
            if len(self._f2a_plans) >= _MAX_PLANS:
                self._f2a_plans.clear()
            self._f2a_plans[key] = (pg, self._peers[0])
        output = output.contiguous()
        works = []
        start = 0
        total = metadata.num_tokens
        for peer, n in zip(self._peers, metadata.seq_lens, strict=True):
            if n:  # a peer with every row (one peer, always) gets the whole tensor: no slice
                works.append(pg.send([output if n == total else output[start : start + n]], peer, 0))
            start += n
        # completed by the next recv_attn_output of this stage (or close); keeps `output` alive
        self._inflight[metadata.stage_idx] = (works, [output])
