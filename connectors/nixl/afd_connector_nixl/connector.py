"""``NixlAFDConnector`` (alias ``nixl``): one-sided NIXL writes with notifications, over UCX.

The world is FFN-first (any A ≥ F), like ``p2p``. Set-up, in ``open()``:

1. the ZMQ control plane's rendezvous and handshake (a mismatched peer fails
   before anything is registered);
2. every rank registers its regions once, sized from ``max_num_tokens``: an
   FFN rank one receive region per (stage, attention peer) and one send
   region per stage; an attention rank one send and one receive region per stage;
3. each rank publishes its agent metadata and regions in a ``TCPStore``
   bound to ``afd.host`` (``store_port``, default ``afd.port + F``) and loads
   its peers' (msgspec; nothing pickled).

Per layer and stage, the attention rank writes its hidden states (and
extras), one request, into the FFN rank's receive region for that stage; the
notification carries (layer, stage, tokens). The FFN rank answers the same
way into the attention rank's receive region. What arrives is used in place:
the FFN computes straight on its receive region. NIXL writes only from
registered memory, so a write starts in place from a registered source (the
connector's own regions, or a storage sent from a second time while alive:
see :meth:`Agent.source`), and otherwise from a copy in the registered send
region (from ``DIRECT_MIN_BYTES``, a registration for that one write).
A single-peer send that passed its checks once keeps a plan, as ``zmq`` does.

Fan-in (several attention peers per FFN rank): each attention rank writes its
rows straight into its slice of the FFN's one receive region, so the batch
arrives concatenated, with no gather. The slice moves with the step's token
counts, which only the FFN rank knows once it has merged its peers' control
payloads: when the step is applied, the FFN rank sends each peer its first
row per stage (a row-offset notification), and an attention rank's first
write of a step waits for it — normally already there after layer 0's attention.

Every wait polls NIXL (progress thread off) with back-off, has the
``timeout_s`` deadline, and asks the control plane for the peer's liveness
every few milliseconds: a peer that dies, freezes or becomes unreachable is a
``PeerLostError``, never a hang. The same code registers VRAM for CUDA tensors.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, NamedTuple, TypeVar

import msgspec
import torch

from afd_connector_nixl.agent import Agent, AgentInfo, Region, nixl_api
from afd_sdk.config import AFDConfig
from afd_sdk.connector import AFDConnector, ConnectorCapabilities, ConnectorContext
from afd_sdk.control import PlanCache, ZmqControlPlane, check_store_port, open_tcp_store
from afd_sdk.errors import ConnectorError, PeerLostError, WireFormatError
from afd_sdk.topology import FFNFirstWorld
from afd_sdk.wire import COMMON_DTYPES, A2FPayload, ControlPayload, TransferMetadata, dtype_from_name

logger = logging.getLogger(__name__)

__all__ = ["NixlAFDConnector", "NixlExtraConfig"]

_ALIGN = 64
#: from this many bytes per write on, a fresh source tensor is registered for the write instead of copied into a
#: registered region. Measured between two processes (fp32, UCX over loopback): registering, preparing and
#: releasing a write cost 70-110 µs more than a prepared request at 512 KiB, where the copy costs 35-50 µs;
#: at 4 MiB the copy costs 350-370 µs and registering wins (round trip 1.34 ms against 1.87 ms)
DIRECT_MIN_BYTES = 2 << 20


class NixlExtraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``connector_extra_config`` of ``NixlAFDConnector``.

    * ``store_port``: port of the ``TCPStore`` (hosted by FFN rank 0, bound to
      ``afd.host``) through which the ranks exchange NIXL metadata at ``init``;
      default ``afd.port + num_ffn_ranks``.
    * ``spin_us``: how long a wait spins before it sleeps with back-off
      (default 2000). NIXL runs without its progress thread, so a sleeping side
      also delays the peer's writes into it; lower it where cores are scarcer
      than latency matters.
    * ``register_sources``: register a tensor storage that is sent from a
      second time while alive, and write from it in place from then on
      (default true; static buffers skip the staging copy). Off, every fresh
      tensor is copied into the registered staging region, and nothing but the
      connector's own regions is ever registered (or pinned, on RDMA).
    """

    store_port: int | None = None
    spin_us: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 2000
    register_sources: bool = True


class _Block(NamedTuple):
    """One tensor's place in a region: hidden states first, then each declared extra."""

    name: str
    dtype: torch.dtype
    trailing: tuple[int, ...]
    row_bytes: int
    offset: int  # bytes from the region's start (room for max_num_tokens rows)


class _Plan(NamedTuple):
    """A single-peer send whose checks passed once: how to write it again (the steady state)."""

    peer: str
    stage: int
    note: bytes
    nbytes: int
    remote: Region
    remote_at: int
    staging: str  # the registered region a fresh tensor is copied into
    staging_at: int
    local: Region  # the staging region, registered
    sent: tuple[int, int]  # attention: the send record, (layer, tokens)
    what: str  # %-format naming the write in errors, formatted only then
    what_args: tuple[int, int, int]  # (layer, stage, peer rank)


_V = TypeVar("_V")


class _StepPlane(ZmqControlPlane):
    """The ZMQ control plane, calling ``on_step(payload)`` whenever a step is applied (both roles apply each step)."""

    def __init__(
        self, context: ConnectorContext, *, connector_name: str, on_step: Callable[[ControlPayload], None]
    ) -> None:
        super().__init__(context, connector_name=connector_name)
        self._on_step = on_step

    def apply(self, payload: ControlPayload) -> None:
        super().apply(payload)
        self._on_step(payload)


class NixlAFDConnector(AFDConnector):
    """NIXL one-sided writes with notifications (UCX: RDMA, NVLink, CMA or TCP as UCX picks)."""

    name = "NixlAFDConnector"
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        world_layout="ffn_first",
        attention_lt_ffn=False,
        supports_extras=True,
        dtypes=COMMON_DTYPES,
    )
    extra_config_schema = NixlExtraConfig
    raw_baselines: ClassVar[Mapping[str, str | None]] = {"nixl": "afd_connector_nixl.raw:RawNixl", "zmq": None}

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.device = torch.device(context.device)
        self._dtype = dtype_from_name(context.model.dtype)
        hidden = context.model.hidden_size
        self._max = max(1, int(context.max_num_tokens))
        self._specs = [("hidden_states", self._dtype, (hidden,))]
        self._specs += [(e.name, dtype_from_name(e.dtype), tuple(e.trailing_shape)) for e in context.ffn_extras]
        # one attention rank's hidden states and extras, max_num_tokens rows each (its send region)
        self._blocks, self._region_bytes = self._layout(self._max)
        self._out_row = hidden * self._dtype.itemsize
        self._row_bytes = sum(b.row_bytes for b in self._blocks)  # one token's hidden states and extras
        #: attention peers of the FFN rank (on either side): how many slices its receive regions hold
        self._fan_in = 1
        # the FFN's receive region, max_num_tokens rows per fan-in peer (sized in open(), once the world is known)
        self._in_blocks, self._in_bytes = self._blocks, self._region_bytes
        #: rows per attention peer in the FFN's receive regions: the FFN's max_num_tokens (adopted at open())
        self._ffn_max = self._max
        self._region_blocks: dict[str, tuple[_Block, ...]] = {}
        self._step_rows: dict[int, tuple[object, int]] = {}  # attention: stage -> (step payload, first row)
        self._agent: Agent | None = None
        self._store: Any = None
        self._peers: tuple[int, ...] = ()  # role ranks of the other role this rank talks to
        self._peer_names: tuple[str, ...] = ()
        self._local: dict[str, Region] = {}
        self._tensors: dict[str, torch.Tensor] = {}  # keeps registered memory alive
        self._remote: list[dict[str, Region]] = []  # per peer
        self._cp_lock = threading.Lock()
        # steady state repeats (region, block, rows): typed views and raw byte views are built once
        self._views: PlanCache[tuple[str, int, int, int], torch.Tensor] = PlanCache()
        self._on_cpu = self.device.type == "cpu"
        self._a2f_names = [f"a2f/{s}" for s in range(context.config.num_stages)]
        self._f2a_names = [f"f2a/{s}" for s in range(context.config.num_stages)]
        #: the steady state's memoised checks, by (metadata, shape, dtype, get_device()) of a valid single-peer send
        self._send_plans: PlanCache[tuple[Any, ...], _Plan] = PlanCache()
        self._f2a_plans: PlanCache[tuple[Any, ...], _Plan] = PlanCache()
        #: ffn side: (layer, stage, seq_lens) -> the metadata of what arrived
        self._a2f_metadata: PlanCache[tuple[int, int, tuple[int, ...]], TransferMetadata] = PlanCache()
        #: ffn side with one peer: (layer, stage, tokens) accepted before -> its payload (views of the region)
        self._a2f_known: PlanCache[tuple[int, int, int], A2FPayload] = PlanCache()
        self._timeout_s = context.config.timeout_s
        self._plane: _StepPlane | None = None

    @classmethod
    def validate_config(cls, config: AFDConfig) -> None:
        super().validate_config(config)
        check_store_port(config.port, config.connector_extra_config.get("store_port"), config.num_ffn_ranks)

    def _layout(self, rows: int) -> tuple[tuple[_Block, ...], int]:
        """Blocks of hidden states then each extra, ``rows`` rows each, every block aligned; and the total bytes."""
        blocks, offset = [], 0
        for name, dtype, trailing in self._specs:
            row = math.prod(trailing) * dtype.itemsize
            blocks.append(_Block(name, dtype, trailing, row, offset))
            offset += -(-rows * row // _ALIGN) * _ALIGN
        return tuple(blocks), offset

    # --- lifecycle ----------------------------------------------------------

    def open(self) -> None:
        nixl_api()  # not installed: a ConnectorError that says how to install, before any socket
        cfg = self.config
        plane = self._plane = _StepPlane(self.context, connector_name=self.name, on_step=self._send_row_offsets)
        self.attach_control_plane(plane)
        world = self.world
        assert isinstance(world, FFNFirstWorld)
        self._peers = plane.peers  # the fan-in peers on the FFN side, the one FFN rank on the attention side
        ffn_rank = self.role_rank if self.role == "ffn" else world.ffn_for_attention(self.role_rank)
        self._fan_in = len(world.attention_for_ffn(ffn_rank))
        self._in_blocks, self._in_bytes = self._layout(self._fan_in * self._max)
        peer_role = "attention" if self.role == "ffn" else "ffn"
        self._agent = agent = Agent(
            self._agent_name(self.role, self.role_rank),
            spin_s=self.extra.spin_us * 1e-6,
            register_sources=self.extra.register_sources,
        )
        self._register(agent)
        rank = world.global_rank(self.role, self.role_rank)
        store_port = self.extra.store_port or cfg.port + cfg.num_ffn_ranks
        # the handshake above met every peer: the store's rendezvous needs only the exchange deadline; its master is
        # world rank 0, FFN rank 0, at its own address (afd.ffn_hosts[0] where the pool spans hosts)
        self._store = open_tcp_store(cfg.ffn_host(0), store_port, world.world_size, rank == 0, cfg.timeout_s, self.name)
        self._store.set(self._agent_name(self.role, self.role_rank), agent.info(self._local, self._max))
        infos: list[AgentInfo] = []
        for peer in self._peers:
            key = self._agent_name(peer_role, peer)
            try:
                blob = self._store.get(key)
            except Exception as exc:  # torch raises DistStoreError / RuntimeError on timeout or a lost master
                raise PeerLostError(
                    f"no NIXL metadata from {peer_role} rank {peer} (store key {key!r}) within "
                    f"{cfg.timeout_s:g}s: {exc}"
                ) from exc
            infos.append(agent.add_peer(blob))
        self._peer_names = tuple(i.name for i in infos)
        self._remote = [i.regions for i in infos]
        if self.role == "attention":
            self._adopt_ffn_layout(infos[0].max_num_tokens or self._max)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _adopt_ffn_layout(self, ffn_max: int) -> None:
        """Attention side: write at the offsets of the FFN's receive layout, sized from *its* max_num_tokens.

        The roles may size differently (a vLLM engine sizes from its ``max_num_batched_tokens``, a standalone
        FFN server from its own): what matters is that the FFN holds what this rank may send.
        """
        ffn = self._peers[0]
        if ffn_max < self._max:
            raise ConnectorError(
                f"ffn rank {ffn}'s receive regions hold max_num_tokens={ffn_max} rows per attention rank; this "
                f"rank may send max_num_tokens={self._max}: give the FFN side a max_num_tokens of at least "
                f"{self._max}"
            )
        self._in_blocks, self._in_bytes = self._layout(self._fan_in * ffn_max)
        self._ffn_max = ffn_max
        for s in range(self.config.num_stages):
            got = self._remote[0][f"a2f/{s}"].nbytes
            if got != self._in_bytes:  # same rows, other bytes: the roles disagree on the extras' shapes or dtypes
                raise ConnectorError(
                    f"ffn rank {ffn}'s receive region for stage {s} holds {got} bytes; this rank expects "
                    f"{self._in_bytes} ({self._fan_in} peers × max_num_tokens={ffn_max} rows of "
                    f"{[b.name for b in self._in_blocks]}): run both roles with the same model and FFN extras"
                )

    def _agent_name(self, role: str, rank: int) -> str:
        return f"afd-nixl-{self.config.port}-{role}{rank}"

    def _register(self, agent: Agent) -> None:
        """Allocate and register this rank's regions once; their names are what peers write to."""
        stages = self.config.num_stages
        if self.role == "ffn":
            for s in range(stages):
                self._add_region(agent, f"a2f/{s}", self._in_bytes, self._in_blocks)
                self._add_region(agent, f"out/{s}", len(self._peers) * self._max * self._out_row, self._blocks[:1])
        else:
            for s in range(stages):
                self._add_region(agent, f"send/{s}", self._region_bytes, self._blocks)
                self._add_region(agent, f"f2a/{s}", self._max * self._out_row, self._blocks[:1])

    def _add_region(self, agent: Agent, name: str, nbytes: int, blocks: tuple[_Block, ...]) -> None:
        t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._tensors[name] = t
        self._region_blocks[name] = blocks
        self._local[name] = agent.register(t)

    def release(self) -> None:
        self._plane = None  # closed by close() already
        agent, self._agent = self._agent, None
        if agent is not None:
            agent.close()
        self._store = None
        self._local.clear()
        self._tensors.clear()
        self._region_blocks.clear()
        self._step_rows.clear()
        self._remote = []
        self._views.clear()
        self._send_plans.clear()
        self._f2a_plans.clear()
        self._a2f_metadata.clear()
        self._a2f_known.clear()

    # --- helpers --------------------------------------------------------------

    def _ready(self, stage_idx: int) -> Agent:
        self.check_stage(stage_idx)
        if self._agent is None:
            raise ConnectorError(f"{self.name} is not initialised; call init() first")
        return self._agent

    def _check_alive(self, what: str) -> None:
        """The liveness check a wait runs every few ms: the control plane's, serialised across stage threads."""
        control = self.require_control_plane()
        with self._cp_lock:  # stage threads wait side by side; the plane is not thread-safe
            control.check_alive(what)  # type: ignore[attr-defined]

    def _view(self, name: str, b: int, rows: int, start_row: int = 0) -> torch.Tensor:
        """Block ``b`` of region ``name``, rows ``start_row .. start_row+rows``, typed ``[rows, *trailing]``."""
        key = (name, b, rows, start_row)
        view = self._views.get(key)
        if view is None:
            block = self._region_blocks[name][b]
            at = block.offset + start_row * block.row_bytes
            raw = self._tensors[name][at : at + rows * block.row_bytes]
            view = self._views.remember(key, raw.view(block.dtype).view(rows, *block.trailing))
        return view

    def _stage_copy(self, name: str, at: int, t: torch.Tensor, nbytes: int) -> None:
        """Copy contiguous ``t`` (``nbytes``) to byte ``at`` of registered region ``name``, the staging copy.

        On the CPU one ``memmove`` from the tensor's address: no torch or numpy
        object per call (their creation cost more than the copy up to 64 KiB).
        """
        dst = self._tensors[name]
        if self._on_cpu:
            ctypes.memmove(dst.data_ptr() + at, t.data_ptr(), nbytes)
        else:
            dst[at : at + nbytes].copy_(t.view(-1).view(torch.uint8))

    def _deadline(self) -> float:
        return time.monotonic() + self._timeout_s

    def _check_tensor(self, t: torch.Tensor, what: str) -> None:
        """The model's dtype on this connector's device: what the regions were registered for."""
        if t.dtype != self._dtype or t.device != self.device:
            raise ConnectorError(f"{what} is {t.dtype} on {t.device}; expected {self._dtype} on {self.device}")

    def _too_many(self, n: int) -> ConnectorError:
        return ConnectorError(
            f"{n} tokens exceed max_num_tokens={self._max}, the size {self.name} registered "
            "its regions for; raise the runtime's max_num_tokens"
        )

    def _write_one(self, plan: _Plan, t: torch.Tensor) -> None:
        """Write ``t`` (contiguous, ``plan.nbytes``) as ``plan`` says, in place or staged, and complete it.

        From a registered source (:meth:`Agent.source`: a static buffer, or
        the FFN's receive region echoed back) the write starts in place; a
        fresh tensor is copied into the staging region first, or registered
        for this one write from ``DIRECT_MIN_BYTES`` on.
        """
        agent = self._agent
        assert agent is not None
        region = agent.source(t)
        reg = None
        if region is not None:
            at = t.data_ptr() - region.addr
            handle = agent.write_one(plan.peer, region, at, plan.remote, plan.remote_at, plan.nbytes, plan.note)
        elif plan.nbytes >= DIRECT_MIN_BYTES:
            handle, reg = agent.write_from(plan.peer, ((t, plan.remote, plan.remote_at),), plan.note)
        else:
            self._stage_copy(plan.staging, plan.staging_at, t, plan.nbytes)
            handle = agent.write_one(
                plan.peer, plan.local, plan.staging_at, plan.remote, plan.remote_at, plan.nbytes, plan.note
            )
        try:
            agent.complete((handle,), self._deadline(), self._check_alive, plan.what, *plan.what_args)
        finally:
            if reg is not None:
                agent.release_from(handle, reg)

    # --- attention side -----------------------------------------------------

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        # the steady state: every check below depends only on (metadata, shape, dtype, device index) and on state fixed
        # for the session, so a key that passed them once passes again (a plan exists only for an initialised
        # attention side with one FFN peer per FFN rank and no declared extras); per call: no send pending
        key = (metadata, hidden_states.shape, hidden_states.dtype, hidden_states.get_device())
        plan = self._send_plans.get(key)
        if plan is not None and extras is None and metadata.stage_idx not in self.sends:
            self._send_planned(plan, hidden_states)
            return
        self.require_role("attention", "send_attn_output")
        stage = metadata.stage_idx
        agent = self._ready(stage)
        n = self.check_attn_send(hidden_states, metadata)
        self._check_tensor(hidden_states, "hidden_states")
        if n > self._max:
            raise self._too_many(n)
        self.check_no_send_pending(stage)
        tensors = [hidden_states, *self.check_extras(extras, n)] if len(self._blocks) > 1 else [hidden_states]
        layer = metadata.layer_idx
        note = agent.note(layer, stage, n)
        peer = self._peer_names[0]
        remote = self._remote[0][f"a2f/{stage}"]
        if self._fan_in == 1 and len(tensors) == 1:
            src = f"send/{stage}"
            plan = _Plan(
                peer,
                stage,
                note,
                n * self._row_bytes,
                remote,
                0,
                src,
                0,
                self._local[src],
                (layer, n),
                "write of layer %d, stage %d to ffn rank %d",
                (layer, stage, self._peers[0]),
            )
            self._send_planned(self._send_plans.remember(key, plan), hidden_states)
            return
        # with fan-in, every step's row offset is taken, also by a zero-token stage: the next step's must be next
        first = self._first_row(agent, stage) if self._fan_in > 1 else 0
        if n:
            at = [b.offset + first * b.row_bytes for b in self._in_blocks]  # our slice of each receive block
            what, what_args = "write of layer %d, stage %d to ffn rank %d", (layer, stage, self._peers[0])
            tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]
            sources = [agent.source(t) for t in tensors]
            if n * self._row_bytes >= DIRECT_MIN_BYTES and not any(sources):  # registering costs less than copying
                handle, reg = agent.write_from(
                    peer, [(t, remote, off) for t, off in zip(tensors, at, strict=True)], note
                )
                try:
                    agent.complete((handle,), self._deadline(), self._check_alive, what, *what_args)
                finally:
                    agent.release_from(handle, reg)
            else:
                src, pieces = f"send/{stage}", []
                for b, t, region, off in zip(self._blocks, tensors, sources, at, strict=True):
                    nbytes = n * b.row_bytes
                    if region is None:
                        self._stage_copy(src, b.offset, t, nbytes)
                        pieces.append((self._local[src], b.offset, remote, off, nbytes))
                    else:
                        pieces.append((region, t.data_ptr() - region.addr, remote, off, nbytes))
                handle = agent.write(peer, pieces, note)
                agent.complete((handle,), self._deadline(), self._check_alive, what, *what_args)
        else:
            agent.notify(peer, note)
        self.record_send(metadata, n)

    def _send_planned(self, plan: _Plan, hidden_states: torch.Tensor) -> None:
        """An attention send whose checks passed before: send it as ``plan`` says and record it."""
        self._send_plan(plan, hidden_states)
        self.sends[plan.stage] = plan.sent

    def _send_plan(self, plan: _Plan, t: torch.Tensor) -> None:
        """Send ``t`` as ``plan`` says: write it (contiguous), or for zero tokens notify the peer."""
        if plan.nbytes:
            self._write_one(plan, t if t.is_contiguous() else t.contiguous())
        else:
            agent = self._agent
            assert agent is not None
            agent.notify(plan.peer, plan.note)

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        self.require_role("attention", "recv_ffn_output")
        agent = self._ready(stage_idx)
        layer, n = self.take_send(stage_idx)
        if ref_tensor.shape != (n, self._hidden_size):
            raise ConnectorError(f"ref_tensor shape {list(ref_tensor.shape)}; expected [{n}, {self._hidden_size}]")
        got_layer, got = agent.receive(
            self._peer_names[0],
            stage_idx,
            self._deadline(),
            self._check_alive,
            "ffn output of layer %d, stage %d from ffn rank %d",
            layer,
            stage_idx,
            self._peers[0],
        )
        if got_layer != layer or got != n:
            raise WireFormatError(
                f"ffn rank {self._peers[0]} answered layer {got_layer} with {got} tokens on stage "
                f"{stage_idx}; expected layer {layer} with {n}"
            )
        return self._view(self._f2a_names[stage_idx], 0, n)

    # --- ffn side -------------------------------------------------------------

    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        self.require_role("ffn", "recv_attn_output")
        agent = self._ready(stage_idx)
        if len(self._peers) == 1:
            return self._recv_one(agent, stage_idx)
        deadline = self._deadline()
        layers, counts = [], []
        for a, name in zip(self._peers, self._peer_names, strict=True):
            layer, n = agent.receive(
                name,
                stage_idx,
                deadline,
                self._check_alive,
                "hidden states of stage %d from attention rank %d",
                stage_idx,
                a,
            )
            if n > self._max:
                raise WireFormatError(f"attention rank {a} announced {n} tokens; regions hold {self._max}")
            layers.append(layer)
            counts.append(n)
        if len(set(layers)) != 1:
            raise WireFormatError(
                f"attention peers {list(self._peers)} sent layers {layers} on stage {stage_idx}; "
                "expected the same layer from each"
            )
        control = self.control_plane
        payload = control.current if control is not None else None
        seq_lens = tuple(counts)
        if payload is not None and stage_idx < payload.num_stages:
            announced = payload.stage_token_counts[stage_idx]
            if tuple(announced) != seq_lens:
                raise WireFormatError(
                    f"stage {stage_idx} carried {counts} tokens; the step announced {list(announced)}"
                )
        key = (layers[0], stage_idx, seq_lens)
        metadata = self._a2f_metadata.get(key)
        if metadata is None:
            metadata = self._a2f_metadata.remember(key, TransferMetadata(layers[0], stage_idx, seq_lens))
        tensors = self._arrived(stage_idx, sum(counts))
        extras = {b.name: t for b, t in zip(self._blocks[1:], tensors[1:], strict=True)}
        return A2FPayload(tensors[0], metadata, extras)

    def _recv_one(self, agent: Agent, stage: int) -> A2FPayload:
        """``recv_attn_output`` with one attention peer: the same checks, with what arrived before remembered.

        The payload of a (layer, stage, tokens) accepted before is returned again, as ``p2p`` does: its
        tensors are the receive region's views, which hold this message now.
        """
        peer = self._peers[0]
        layer, n = agent.receive(
            self._peer_names[0],
            stage,
            time.monotonic() + self._timeout_s,
            self._check_alive,
            "hidden states of stage %d from attention rank %d",
            stage,
            peer,
        )
        key = (layer, stage, n)
        got = self._a2f_known.get(key)
        if got is None:
            if n > self._max:
                raise WireFormatError(f"attention rank {peer} announced {n} tokens; regions hold {self._max}")
            tensors = self._arrived(stage, n)
            extras = {b.name: t for b, t in zip(self._blocks[1:], tensors[1:], strict=True)}
            got = self._a2f_known.remember(key, A2FPayload(tensors[0], TransferMetadata(layer, stage, (n,)), extras))
        payload = self._plane.current if self._plane is not None else None
        if payload is not None and stage < len(payload.stage_token_counts):
            announced = payload.stage_token_counts[stage]
            if announced != got.metadata.seq_lens and tuple(announced) != got.metadata.seq_lens:
                raise WireFormatError(f"stage {stage} carried {[n]} tokens; the step announced {list(announced)}")
        return got

    def _arrived(self, stage: int, total: int) -> list[torch.Tensor]:
        """The received tensors, in place: every peer wrote its rows at its slice, so the batch is contiguous."""
        name = self._a2f_names[stage]
        return [self._view(name, i, total) for i in range(len(self._blocks))]

    # --- fan-in row offsets ------------------------------------------------------

    def _send_row_offsets(self, payload: ControlPayload) -> None:
        """FFN side, when a step is applied: tell each attention peer where its rows go in every stage."""
        if self.role != "ffn" or self._fan_in == 1 or self._agent is None:
            return
        agent = self._agent
        for stage, counts in enumerate(payload.stage_token_counts):
            if len(counts) != len(self._peers) or max(counts) > self._max:
                raise WireFormatError(
                    f"step {payload.step_idx} announces {list(counts)} tokens on stage {stage} "
                    f"for {len(self._peers)} peers of at most {self._max} each"
                )
            first = 0
            for name, n in zip(self._peer_names, counts, strict=True):
                agent.notify(name, agent.offset_note(payload.step_idx, stage, first))
                first += n

    def _first_row(self, agent: Agent, stage: int) -> int:
        """Attention side: this rank's first row in the FFN's receive region for the current step and ``stage``."""
        control = self.control_plane
        payload = control.current if control is not None else None
        if payload is None:
            raise ConnectorError(
                f"{self.name} with fan-in needs the step's ControlPayload before data moves: the "
                "attention runner announces it (announce_step) before layer 0"
            )
        known = self._step_rows.get(stage)
        if known is not None and known[0] is payload:
            return known[1]
        ffn = self._peers[0]
        step, first = agent.receive_offset(
            self._peer_names[0],
            stage,
            self._deadline(),
            self._check_alive,
            "row offset of step %d, stage %d from ffn rank %d",
            payload.step_idx,
            stage,
            ffn,
        )
        if step != payload.step_idx & 0xFFFFFFFF or first > (self._fan_in - 1) * self._ffn_max:
            raise WireFormatError(
                f"ffn rank {ffn} sent row {first} for step {step}, stage {stage}; expected step "
                f"{payload.step_idx} and a row of its {self._fan_in}-peer region"
            )
        self._step_rows[stage] = (payload, first)
        return first

    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        # one peer, the steady state: the checks below depend only on (metadata, shape, dtype, device) and on
        # state fixed for the session (a plan exists only on an initialised ffn side with one peer)
        key = (metadata, output.shape, output.dtype, output.get_device())
        plan = self._f2a_plans.get(key)
        if plan is not None:
            self._send_plan(plan, output)
            return
        self.require_role("ffn", "send_ffn_output")
        stage = metadata.stage_idx
        agent = self._ready(stage)
        self.check_ffn_send(output, metadata, len(self._peers))
        self._check_tensor(output, "ffn output")
        output = output if output.is_contiguous() else output.contiguous()
        src, row, layer = f"out/{stage}", self._out_row, metadata.layer_idx
        what = "write of ffn output of layer %d, stage %d to attention rank %d"
        if len(self._peers) == 1:
            n = metadata.seq_lens[0]
            remote = self._remote[0][f"f2a/{stage}"]
            plan = _Plan(
                self._peer_names[0],
                stage,
                agent.note(layer, stage, n),
                n * row,
                remote,
                0,
                src,
                0,
                self._local[src],
                (layer, n),
                what,
                (layer, stage, self._peers[0]),
            )
            self._send_plan(self._f2a_plans.remember(key, plan), output)
            return
        total = metadata.num_tokens * row
        region = agent.source(output) if total else None
        direct = region is None and total >= DIRECT_MIN_BYTES  # registering costs less than copying
        if region is None and not direct and total:
            self._stage_copy(src, 0, output, total)
        handles, registrations, start = [], [], 0
        try:
            for i, n in enumerate(metadata.seq_lens):
                note = agent.note(layer, stage, n)
                remote, peer = self._remote[i][f"f2a/{stage}"], self._peer_names[i]
                if not n:
                    agent.notify(peer, note)
                elif direct:
                    handle, reg = agent.write_from(peer, [(output[start : start + n], remote, 0)], note)
                    handles.append(handle)
                    registrations.append((handle, reg))
                elif region is not None:
                    at = output.data_ptr() - region.addr + start * row
                    handles.append(agent.write(peer, [(region, at, remote, 0, n * row)], note))
                else:
                    handles.append(agent.write(peer, [(self._local[src], start * row, remote, 0, n * row)], note))
                start += n
            if handles:
                agent.complete(
                    handles,
                    self._deadline(),
                    self._check_alive,
                    "write of ffn output of layer %d, stage %d",
                    layer,
                    stage,
                )
        finally:
            for handle, reg in registrations:
                agent.release_from(handle, reg)
