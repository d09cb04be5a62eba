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
of one preallocated buffer, so fan-in costs no extra copy.
"""

from __future__ import annotations

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
)
from afd_sdk.errors import AFDConfigError, ConnectorError
from afd_sdk.topology import FFNFirstWorld
from afd_sdk.wire import COMMON_DTYPES, A2FPayload, TransferMetadata, dtype_from_name

logger = logging.getLogger(__name__)

__all__ = ["P2pExtraConfig", "P2pNcclAFDConnector"]


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

    def release(self) -> None:
        groups, self._groups = self._groups, []
        shutdown_groups(groups, self.name)
        self._store = None
        self._bufs.clear()
        self._inflight.clear()
        self._plans.clear()
        self._layer.clear()
        self._step_of.clear()

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

    def _next_layer(self, stage_idx: int) -> int:
        layer = self._layer[stage_idx]
        self._layer[stage_idx] = layer + 1
        return layer

    # --- attention side -----------------------------------------------------

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
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
        self._next_layer(metadata.stage_idx)
        if n:
            # completed in recv_ffn_output: a blocking send could deadlock against interleaved stages
            tensors = [t.contiguous() for t in tensors]
            self._inflight[metadata.stage_idx] = ([pg.send([t], self._peers[0], 0) for t in tensors], tensors)
        self.record_send(metadata, n)

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        self.require_role("attention", "recv_ffn_output")
        pg = self._group(stage_idx)
        layer, n = self.take_send(stage_idx)
        if tuple(ref_tensor.shape) != (n, self._hidden):
            raise ConnectorError(f"ref_tensor shape {list(ref_tensor.shape)}; expected [{n}, {self._hidden}]")
        out = self._bufs.get(("f2a", stage_idx), n, (self._hidden,), ref_tensor.dtype, ref_tensor.device)
        if n:
            recv = pg.recv([out], self._peers[0], 0)
            self._finish_sends(stage_idx, "send of layer %d to ffn rank %d", layer, self._peers[0])
            self._wait([recv], "ffn output of layer %d, stage %d", layer, stage_idx)
        return out

    def _finish_sends(self, stage_idx: int, what: str, *what_args: object) -> None:
        """Wait for ``stage_idx``'s sends still in flight (if any) and drop the tensors they kept alive."""
        works, _keepalive = self._inflight.pop(stage_idx, ((), ()))
        if works:
            self._wait(works, what, *what_args)

    # --- ffn side -------------------------------------------------------------

    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        self.require_role("ffn", "recv_attn_output")
        pg = self._group(stage_idx)
        plan = self._recv_plan(stage_idx, self._step_counts(stage_idx))
        self._finish_sends(stage_idx, "send of the previous ffn output, stage %d", stage_idx)
        layer = self._next_layer(stage_idx)
        self._wait([pg.recv([t], peer, 0) for t, peer in plan.posts], "hidden states of layer %d, stage %d", layer,
                   stage_idx)  # fmt: skip
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
        self.require_role("ffn", "send_ffn_output")
        pg = self._group(metadata.stage_idx)
        self.check_ffn_send(output, metadata, len(self._peers))
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
