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

Per layer and stage, the attention rank copies its hidden states (and
extras) into its registered send region and writes them, one request, into
the FFN rank's receive region for that stage; the notification carries
(layer, stage, tokens). The FFN rank answers the same way into the attention
rank's receive region. NIXL writes only from registered memory, so each side
copies what it sends once (the model's tensors are fresh every layer); what
arrives is used in place: the FFN computes straight on its receive region.

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

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, NamedTuple

import msgspec
import numpy
import torch

from afd_connector_nixl.agent import Agent, AgentInfo, Region, nixl_api
from afd_sdk.config import AFDConfig
from afd_sdk.connector import AFDConnector, ConnectorCapabilities, ConnectorContext
from afd_sdk.control import ZmqControlPlane, check_store_port, open_tcp_store
from afd_sdk.errors import ConnectorError, PeerLostError, WireFormatError
from afd_sdk.topology import FFNFirstWorld
from afd_sdk.wire import COMMON_DTYPES, A2FPayload, ControlPayload, TransferMetadata, dtype_from_name

logger = logging.getLogger(__name__)

__all__ = ["NixlAFDConnector", "NixlExtraConfig"]

_ALIGN = 64
_MAX_VIEWS = 4096
#: from this many bytes per write on, the source tensors are registered for the write instead of copied into a
#: registered region: registration costs ~20 µs, a memcpy of 512 KiB ~35 µs and of 4 MiB ~300-400 µs here
DIRECT_MIN_BYTES = 512 << 10


class NixlExtraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``connector_extra_config`` of ``NixlAFDConnector``.

    * ``store_port``: port of the ``TCPStore`` (hosted by FFN rank 0, bound to
      ``afd.host``) through which the ranks exchange NIXL metadata at ``init``;
      default ``afd.port + num_ffn_ranks``.
    * ``spin_us``: how long a wait spins before it sleeps with back-off
      (default 2000). NIXL runs without its progress thread, so a sleeping side
      also delays the peer's writes into it; lower it where cores are scarcer
      than latency matters.
    """

    store_port: int | None = None
    spin_us: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 2000


class _Block(NamedTuple):
    """One tensor's place in a region: hidden states first, then each declared extra."""

    name: str
    dtype: torch.dtype
    trailing: tuple[int, ...]
    row_bytes: int
    offset: int  # bytes from the region's start (room for max_num_tokens rows)


class _StepPlane(ZmqControlPlane):
    """The ZMQ control plane, calling ``on_step(payload)`` whenever a step is applied (both roles apply each step)."""

    def __init__(self, context: ConnectorContext, *, connector_name: str,
                 on_step: Callable[[ControlPayload], None]) -> None:  # fmt: skip
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
    raw_baselines: ClassVar[Mapping[str, str]] = {"nixl": "afd_connector_nixl.raw:RawNixl"}

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
        self._views: dict[tuple[str, int, int, int], torch.Tensor] = {}
        self._bytes: dict[tuple[str, int, int], Any] = {}

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
        plane = _StepPlane(self.context, connector_name=self.name, on_step=self._send_row_offsets)
        self.attach_control_plane(plane)
        world = self.world
        assert isinstance(world, FFNFirstWorld)
        self._peers = plane.peers  # the fan-in peers on the FFN side, the one FFN rank on the attention side
        ffn_rank = self.role_rank if self.role == "ffn" else world.ffn_for_attention(self.role_rank)
        self._fan_in = len(world.attention_for_ffn(ffn_rank))
        self._in_blocks, self._in_bytes = self._layout(self._fan_in * self._max)
        peer_role = "attention" if self.role == "ffn" else "ffn"
        self._agent = agent = Agent(self._agent_name(self.role, self.role_rank), spin_s=self.extra.spin_us * 1e-6)
        self._register(agent)
        rank = world.global_rank(self.role, self.role_rank)
        store_port = self.extra.store_port or cfg.port + cfg.num_ffn_ranks
        # the handshake above met every peer: the store's rendezvous needs only the exchange deadline
        self._store = open_tcp_store(cfg.host, store_port, world.world_size, rank == 0, cfg.timeout_s, self.name)
        self._store.set(self._agent_name(self.role, self.role_rank), agent.info(self._local))
        infos: list[AgentInfo] = []
        for peer in self._peers:
            key = self._agent_name(peer_role, peer)
            try:
                blob = self._store.get(key)
            except Exception as exc:  # torch raises DistStoreError / RuntimeError on timeout or a lost master
                raise PeerLostError(f"no NIXL metadata from {peer_role} rank {peer} (store key {key!r}) within "
                                    f"{cfg.timeout_s:g}s: {exc}") from exc  # fmt: skip
            infos.append(agent.add_peer(blob))
        self._peer_names = tuple(i.name for i in infos)
        self._remote = [i.regions for i in infos]
        if self.role == "attention":  # our writes land at offsets of the FFN's layout: it must be the same
            for s in range(cfg.num_stages):
                got = self._remote[0][f"a2f/{s}"].nbytes
                if got != self._in_bytes:
                    raise ConnectorError(
                        f"ffn rank {self._peers[0]}'s receive region for stage {s} holds {got} bytes; this rank "
                        f"expects {self._in_bytes} ({self._fan_in} peers × max_num_tokens={self._max}): run both "
                        "roles with the same max_num_tokens"
                    )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

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
        self._bytes.clear()

    # --- helpers --------------------------------------------------------------

    def _ready(self, stage_idx: int) -> Agent:
        self.check_stage(stage_idx)
        if self._agent is None:
            raise ConnectorError(f"{self.name} is not initialised; call init() first")
        return self._agent

    def _alive(self, what: Callable[[], str]) -> Callable[[], None]:
        """The liveness check a wait runs every few ms: the control plane's, serialised across stage threads."""
        control = self.require_control_plane()

        def check() -> None:
            with self._cp_lock:  # stage threads wait side by side; the plane is not thread-safe
                control.check_alive(what())  # type: ignore[attr-defined]

        return check

    def _view(self, name: str, b: int, rows: int, start_row: int = 0) -> torch.Tensor:
        """Block ``b`` of region ``name``, rows ``start_row .. start_row+rows``, typed ``[rows, *trailing]``."""
        key = (name, b, rows, start_row)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _MAX_VIEWS:  # token counts vary (prefill): keep the cache bounded
                self._views.clear()
            block = self._region_blocks[name][b]
            at = block.offset + start_row * block.row_bytes
            raw = self._tensors[name][at : at + rows * block.row_bytes]
            view = self._views[key] = raw.view(block.dtype).view(rows, *block.trailing)
        return view

    def _fill(self, name: str, b: int, src: torch.Tensor) -> None:
        """Copy ``src`` into block ``b`` of region ``name``: one memcpy on the CPU (no intra-op thread pool)."""
        rows = src.shape[0]
        if self.device.type != "cpu":
            self._view(name, b, rows).copy_(src)
            return
        key = (name, b, rows)
        dst = self._bytes.get(key)
        if dst is None:
            if len(self._bytes) >= _MAX_VIEWS:
                self._bytes.clear()
            block = self._region_blocks[name][b]
            dst = self._bytes[key] = self._tensors[name][block.offset : block.offset + rows * block.row_bytes].numpy()
        numpy.copyto(dst, src.contiguous().view(-1).view(torch.uint8).numpy())

    def _deadline(self) -> float:
        return time.monotonic() + self.config.timeout_s

    def _check_tensor(self, t: torch.Tensor, what: str) -> None:
        """The model's dtype on this connector's device: what the regions were registered for."""
        if t.dtype != self._dtype or t.device != self.device:
            raise ConnectorError(f"{what} is {t.dtype} on {t.device}; expected {self._dtype} on {self.device}")

    def _too_many(self, n: int) -> ConnectorError:
        return ConnectorError(f"{n} tokens exceed max_num_tokens={self._max}, the size {self.name} registered "
                              "its regions for; raise the runtime's max_num_tokens")  # fmt: skip

    # --- attention side -----------------------------------------------------

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
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
        # with fan-in, every step's row offset is taken, also by a zero-token stage: the next step's must be next
        first = self._first_row(agent, stage) if self._fan_in > 1 else 0
        if n:

            def what() -> str:
                return f"write of layer {layer}, stage {stage} to ffn rank {self._peers[0]}"

            remote = self._remote[0][f"a2f/{stage}"]
            at = [b.offset + first * b.row_bytes for b in self._in_blocks]  # our slice of each receive block
            if n * self._row_bytes >= DIRECT_MIN_BYTES:  # registering the tensors costs less than copying them
                sources = [(t.contiguous(), remote, off) for off, t in zip(at, tensors, strict=True)]
                handle, reg = agent.write_from(peer, sources, note)
                try:
                    agent.complete([handle], self._deadline(), self._alive(what), what)
                finally:
                    agent.release_from(handle, reg)
            else:
                src = f"send/{stage}"
                for b, t in enumerate(tensors):
                    self._fill(src, b, t)
                local = self._local[src]
                pieces = [(local, b.offset, remote, off, n * b.row_bytes)
                          for b, off in zip(self._blocks, at, strict=True)]  # fmt: skip
                agent.complete([agent.write(peer, pieces, note)], self._deadline(), self._alive(what), what)
        else:
            agent.notify(peer, note)
        self.record_send(metadata, n)

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        self.require_role("attention", "recv_ffn_output")
        agent = self._ready(stage_idx)
        layer, n = self.take_send(stage_idx)
        if tuple(ref_tensor.shape) != (n, self._hidden_size):
            raise ConnectorError(f"ref_tensor shape {list(ref_tensor.shape)}; expected [{n}, {self._hidden_size}]")
        ffn = self._peers[0]

        def what() -> str:
            return f"ffn output of layer {layer}, stage {stage_idx} from ffn rank {ffn}"

        got_layer, got = agent.receive(self._peer_names[0], stage_idx, self._deadline(), self._alive(what), what)
        if (got_layer, got) != (layer, n):
            raise WireFormatError(f"ffn rank {ffn} answered layer {got_layer} with {got} tokens on stage "
                                  f"{stage_idx}; expected layer {layer} with {n}")  # fmt: skip
        return self._view(f"f2a/{stage_idx}", 0, n)

    # --- ffn side -------------------------------------------------------------

    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        self.require_role("ffn", "recv_attn_output")
        agent = self._ready(stage_idx)
        deadline = self._deadline()
        layers, counts = [], []
        for a, name in zip(self._peers, self._peer_names, strict=True):

            def what(a: int = a) -> str:
                return f"hidden states of stage {stage_idx} from attention rank {a}"

            layer, n = agent.receive(name, stage_idx, deadline, self._alive(what), what)
            if n > self._max:
                raise WireFormatError(f"attention rank {a} announced {n} tokens; regions hold {self._max}")
            layers.append(layer)
            counts.append(n)
        if len(set(layers)) != 1:
            raise WireFormatError(f"attention peers {list(self._peers)} sent layers {layers} on stage {stage_idx}; "
                                  "expected the same layer from each")  # fmt: skip
        control = self.control_plane
        payload = control.current if control is not None else None
        if payload is not None and stage_idx < payload.num_stages:
            announced = tuple(payload.stage_token_counts[stage_idx])
            if announced != tuple(counts):
                raise WireFormatError(f"stage {stage_idx} carried {counts} tokens; the step announced "
                                      f"{list(announced)}")  # fmt: skip
        tensors = self._arrived(stage_idx, counts)
        extras = {b.name: t for b, t in zip(self._blocks[1:], tensors[1:], strict=True)}
        return A2FPayload(tensors[0], TransferMetadata(layers[0], stage_idx, tuple(counts)), extras)

    def _arrived(self, stage: int, counts: list[int]) -> list[torch.Tensor]:
        """The received tensors, in place: every peer wrote its rows at its slice, so the batch is contiguous."""
        total = sum(counts)
        return [self._view(f"a2f/{stage}", i, total) for i in range(len(self._blocks))]

    # --- fan-in row offsets ------------------------------------------------------

    def _send_row_offsets(self, payload: ControlPayload) -> None:
        """FFN side, when a step is applied: tell each attention peer where its rows go in every stage."""
        if self.role != "ffn" or self._fan_in == 1 or self._agent is None:
            return
        agent = self._agent
        for stage, counts in enumerate(payload.stage_token_counts):
            if len(counts) != len(self._peers) or max(counts) > self._max:
                raise WireFormatError(f"step {payload.step_idx} announces {list(counts)} tokens on stage {stage} "
                                      f"for {len(self._peers)} peers of at most {self._max} each")  # fmt: skip
            first = 0
            for name, n in zip(self._peer_names, counts, strict=True):
                agent.notify(name, agent.offset_note(payload.step_idx, stage, first))
                first += n

    def _first_row(self, agent: Agent, stage: int) -> int:
        """Attention side: this rank's first row in the FFN's receive region for the current step and ``stage``."""
        control = self.control_plane
        payload = control.current if control is not None else None
        if payload is None:
            raise ConnectorError(f"{self.name} with fan-in needs the step's ControlPayload before data moves: the "
                                 "attention runner announces it (announce_step) before layer 0")  # fmt: skip
        known = self._step_rows.get(stage)
        if known is not None and known[0] is payload:
            return known[1]
        ffn = self._peers[0]

        def what() -> str:
            return f"row offset of step {payload.step_idx}, stage {stage} from ffn rank {ffn}"

        step, first = agent.receive_offset(self._peer_names[0], stage, self._deadline(), self._alive(what), what)
        if step != payload.step_idx & 0xFFFFFFFF or first > (self._fan_in - 1) * self._max:
            raise WireFormatError(f"ffn rank {ffn} sent row {first} for step {step}, stage {stage}; expected step "
                                  f"{payload.step_idx} and a row of its {self._fan_in}-peer region")  # fmt: skip
        self._step_rows[stage] = (payload, first)
        return first

    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        self.require_role("ffn", "send_ffn_output")
        stage = metadata.stage_idx
        agent = self._ready(stage)
        self.check_ffn_send(output, metadata, len(self._peers))
        self._check_tensor(output, "ffn output")
        src = f"out/{stage}"
        direct = metadata.num_tokens * self._out_row >= DIRECT_MIN_BYTES
        if direct:  # registering the output costs less than copying it; each peer's rows are a contiguous slice
            output = output.contiguous()
        elif metadata.num_tokens:
            self._fill(src, 0, output)
        handles, start = [], 0
        registrations = []
        try:
            for i, n in enumerate(metadata.seq_lens):
                note = agent.note(metadata.layer_idx, stage, n)
                remote = self._remote[i][f"f2a/{stage}"]
                if n and direct:
                    handle, reg = agent.write_from(self._peer_names[i], [(output[start : start + n], remote, 0)], note)
                    handles.append(handle)
                    registrations.append((handle, reg))
                elif n:
                    pieces = [(self._local[src], start * self._out_row, remote, 0, n * self._out_row)]
                    handles.append(agent.write(self._peer_names[i], pieces, note))
                else:
                    agent.notify(self._peer_names[i], note)
                start += n
            self._complete_outputs(agent, handles, metadata)
        finally:
            for handle, reg in registrations:
                agent.release_from(handle, reg)

    def _complete_outputs(self, agent: Agent, handles: list[Any], metadata: TransferMetadata) -> None:
        stage = metadata.stage_idx
        if handles:

            def what() -> str:
                return f"write of ffn output of layer {metadata.layer_idx}, stage {stage}"

            agent.complete(handles, self._deadline(), self._alive(what), what)
