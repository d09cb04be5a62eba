"""``ShmAFDConnector`` (alias ``shm``): same-host shared-memory transport.

Per attention peer and stage, the FFN rank creates one segment in
``/dev/shm`` holding two rings (attention→FFN and FFN→attention) of ``slots``
slots each. A slot is ``[seq u64][header_len u32][pad][msgpack TensorHeader][tensor bytes]``:
the writer copies each tensor once into the slot and publishes ``seq`` last;
the reader spins briefly on ``seq``, then blocks on a FIFO doorbell that the
writer rings only when the reader has flagged itself asleep, so an idle side
burns no core. The reader copies the tensor out once (into a reused buffer,
or for fan-in straight into its part of the concatenated buffer) and frees
the slot.

Segments and FIFOs are unlinked by the FFN rank as soon as every attention
peer has attached, so nothing is left in ``/dev/shm`` after a crash of either
side; open mappings keep working. Liveness of the peer is checked through its
PID (recorded in the segment) while waiting; handshake, per-step control and
goodbye go through :class:`~afd_connectors.zmq_control.ZmqControlPlane`.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import select
import struct
import time
from collections.abc import Callable, Mapping
from typing import ClassVar

import msgspec
import torch

from afd_connectors.frames import (
    TENSOR_DTYPES,
    BufferPool,
    check_extras,
    nbytes_of,
    tensor_bytes,
    tensor_header,
    writable_bytes,
)
from afd_connectors.zmq_control import ZmqControlPlane
from afd_sdk.connector import AFDConnector, ConnectorCapabilities, ConnectorContext, ControlPlane
from afd_sdk.errors import AFDConfigError, ConnectorError, PeerLostError, WireFormatError
from afd_sdk.wire import A2FPayload, TensorHeader, TransferMetadata, decode_header, dtype_from_name, encode_header

logger = logging.getLogger(__name__)

__all__ = ["ShmAFDConnector", "ShmExtraConfig"]

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_LINE = 64  # separate cache lines for the fields two processes write
# segment header (offsets)
_ATTACHED = 0  # u64: attention peer's pid once it mapped the segment
_FFN_PID = _LINE
_CH_HEADER = 2 * _LINE  # two channel headers follow, 3 lines each
_CH_WRITE, _CH_READ, _CH_SLEEP = 0, _LINE, 2 * _LINE  # write seq, read seq, reader-asleep flag
_SLOT_META = 16  # seq u64 + header_len u32 + pad
_HEADER_MAX = 1024


class ShmExtraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``connector_extra_config`` of ``ShmAFDConnector``.

    * ``slots``: slots per ring (default 2).
    * ``spin_us``: how long a reader spins before blocking on the doorbell (default 50).
    * ``shm_dir``: where segments and doorbells live (default ``/dev/shm``).
    """

    slots: int = 2
    spin_us: float = 50.0
    shm_dir: str = "/dev/shm"


class _Ring:
    """One direction of one segment: writer or reader view."""

    def __init__(self, mm: mmap.mmap, base: int, slots_at: int, slots: int, slot_size: int, fifo_fd: int) -> None:
        self.mm = mm
        # plain memcpy through a memoryview: single-threaded, no torch op per message (torch's intra-op
        # pool fights the peer's spinning on small machines)
        self.buf = memoryview(mm)
        self.write_at = base + _CH_WRITE
        self.read_at = base + _CH_READ
        self.sleep_at = base + _CH_SLEEP
        self.slots_at = slots_at
        self.slots = slots
        self.slot_size = slot_size
        self.fifo = fifo_fd
        self.next_seq = 1  # writer: next seq to publish; reader: next seq to consume

    def slot(self, seq: int) -> int:
        return self.slots_at + ((seq - 1) % self.slots) * self.slot_size

    def get(self, at: int) -> int:
        return _U64.unpack_from(self.mm, at)[0]

    def put(self, at: int, value: int) -> None:
        _U64.pack_into(self.mm, at, value)


class _Channel:
    """Both rings of one (attention peer, stage) segment, seen from one side."""

    def __init__(self, path: str, fifos: tuple[str, str], size: int, create: bool, ring_args: tuple[int, int]) -> None:
        self.path = path
        self.fifo_paths = fifos
        self.mm: mmap.mmap | None = None
        self.fds: list[int] = []
        slots, slot_size = ring_args
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
            except OSError:
                os.close(fd)
                raise
            for f in fifos:
                os.mkfifo(f, 0o600)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        # O_RDWR on a FIFO never blocks on Linux and keeps it open for both directions
        self.fds = [os.open(f, os.O_RDWR | os.O_NONBLOCK) for f in fifos]
        data_at = _CH_HEADER + 6 * _LINE
        ring_bytes = slots * slot_size
        a2f = _Ring(self.mm, _CH_HEADER, data_at, slots, slot_size, self.fds[0])
        f2a = _Ring(self.mm, _CH_HEADER + 3 * _LINE, data_at + ring_bytes, slots, slot_size, self.fds[1])
        self.a2f, self.f2a = a2f, f2a

    def unlink(self) -> None:
        for p in (self.path, *self.fifo_paths):
            try:
                os.unlink(p)
            except FileNotFoundError:
                continue  # already unlinked (the FFN side does it once every peer attached)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if self.mm is not None:
            for ring in (self.a2f, self.f2a):
                ring.buf.release()
            try:
                self.mm.close()
            except BufferError as exc:  # a tensor view still references the mapping; it is released with that tensor
                logger.debug("shared-memory segment %s stays mapped until its last view is gone: %s", self.path, exc)
            self.mm = None


class ShmAFDConnector(AFDConnector):
    """Shared-memory transport for Attention and FFN ranks on one host (any A ≥ F)."""

    name = "ShmAFDConnector"
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities(
        devices=frozenset({"cpu"}),
        world_layout="ffn_first",
        attention_lt_ffn=False,
        supports_extras=True,
        dtypes=TENSOR_DTYPES,
        same_host_only=True,
    )
    extra_config_schema = ShmExtraConfig

    @classmethod
    def validate_config(cls, config: object) -> None:  # type: ignore[override]
        super().validate_config(config)  # type: ignore[arg-type]
        extra = config.connector_extra_config  # type: ignore[attr-defined]
        if not 1 <= int(extra.get("slots", 2)) <= 64:
            raise AFDConfigError(
                f"afd.connector_extra_config.slots={extra.get('slots')!r} is invalid; expected an integer in [1, 64]",
                key="afd.connector_extra_config.slots",
                value=extra.get("slots"),
            )
        host = config.host  # type: ignore[attr-defined]
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise AFDConfigError(
                f"afd.host={host!r} is invalid for ShmAFDConnector; expected a loopback address (same host only)",
                key="afd.host",
                value=host,
            )

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self._control: ZmqControlPlane | None = None
        self._channels: dict[tuple[int, int], _Channel] = {}  # (peer index, stage) -> channel
        self._peers: tuple[int, ...] = ()
        self._peer_pids: dict[int, int] = {}
        self._pool = BufferPool()
        self._extras = context.ffn_extras
        self._hidden = context.model.hidden_size
        itemsize = dtype_from_name(context.model.dtype).itemsize
        extra_bytes = sum(
            dtype_from_name(e.dtype).itemsize * max(1, int(torch.tensor(e.trailing_shape).prod())) for e in self._extras
        )
        peers = max(1, -(-context.config.num_attention_ranks // context.config.num_ffn_ranks))
        # a slot carries one peer's tokens (A->F) or one peer's share of the output (F->A)
        self._slot_data = max(4096, context.max_num_tokens * (self._hidden * itemsize + extra_bytes))
        self._slot_size = _SLOT_META + _HEADER_MAX + self._slot_data
        self._slot_size = -(-self._slot_size // _LINE) * _LINE
        self._peers_per_ffn = peers
        self._spin_s = self.extra.spin_us / 1e6
        self._initialized = False

    # --- names and lifecycle -------------------------------------------------------

    def _segment_size(self) -> int:
        return _CH_HEADER + 6 * _LINE + 2 * self.extra.slots * self._slot_size

    def _paths(self, attention_rank: int, stage: int) -> tuple[str, tuple[str, str]]:
        """``<shm_dir>/afd-<port>-a<rank>-s<stage>`` plus its two doorbell FIFOs (unique per world and pair)."""
        base = os.path.join(self.extra.shm_dir, f"afd-{self.config.port}-a{attention_rank}-s{stage}")
        return base, (base + ".a2f", base + ".f2a")

    @property
    def is_initialized(self) -> bool:
        return self._initialized

    @property
    def control_plane(self) -> ControlPlane | None:
        return self._control

    def init(self) -> None:
        if self._initialized:
            raise ConnectorError(f"{self.name}.init() called twice without close()")
        if not os.path.isdir(self.extra.shm_dir):
            raise ConnectorError(f"shared-memory directory {self.extra.shm_dir!r} does not exist")
        cfg = self.config
        self._control = ZmqControlPlane(self.context, connector_name=self.name)
        world = self._control.world
        size = self._segment_size()
        ring = (self.extra.slots, self._slot_size)
        if self.role == "ffn":
            self._peers = world.attention_for_ffn(self.role_rank)
            for i, a in enumerate(self._peers):
                for s in range(cfg.num_stages):
                    path, fifos = self._paths(a, s)
                    self._remove_stale(path, fifos)
                    ch = _Channel(path, fifos, size, True, ring)
                    _U64.pack_into(ch.mm, _FFN_PID, os.getpid())
                    self._channels[(i, s)] = ch
            self._control.init()
            self._wait_attached()
        else:
            self._control.init()
            ffn = world.ffn_for_attention(self.role_rank)
            self._peers = (ffn,)
            for s in range(cfg.num_stages):
                path, fifos = self._paths(self.role_rank, s)
                try:
                    ch = _Channel(path, fifos, size, False, ring)
                except FileNotFoundError as exc:
                    raise ConnectorError(
                        f"shared-memory segment {path} is missing: ShmAFDConnector needs both roles on one host "
                        f"with the same shm_dir ({self.extra.shm_dir})"
                    ) from exc
                _U64.pack_into(ch.mm, _ATTACHED, os.getpid())
                self._peer_pids[0] = _U64.unpack_from(ch.mm, _FFN_PID)[0]
                self._channels[(0, s)] = ch
        self._initialized = True

    def _remove_stale(self, path: str, fifos: tuple[str, str]) -> None:
        """A segment left by a process that died before its peers attached (the only leak window)."""
        for p in (path, *fifos):
            try:
                os.unlink(p)
            except FileNotFoundError:
                continue

    def _wait_attached(self) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        for (i, _s), ch in self._channels.items():
            while True:
                pid = _U64.unpack_from(ch.mm, _ATTACHED)[0]
                if pid:
                    self._peer_pids[i] = pid
                    break
                if time.monotonic() > deadline:
                    raise PeerLostError(f"attention peer {self._peers[i]} did not attach {ch.path} within "
                                        f"{self.config.timeout_s:g}s")  # fmt: skip
                time.sleep(0.0005)
            ch.unlink()  # mapped by both: from now on nothing can be left behind in the directory

    def close(self) -> None:
        self._initialized = False
        control, self._control = self._control, None
        try:
            if control is not None:
                control.close()
        finally:
            for ch in self._channels.values():
                if self.role == "ffn":
                    ch.unlink()
                ch.close()
            self._channels = {}
            self._pool.clear()
            self._sent.clear()
            self._peer_pids = {}

    # --- ring operations ---------------------------------------------------------------

    def _write(self, ring: _Ring, header: TensorHeader, tensors: list[torch.Tensor], peer: int) -> None:
        seq = ring.next_seq
        deadline = None
        while seq - ring.get(ring.read_at) > ring.slots:  # ring full: the reader has not freed the oldest slot
            deadline = deadline or time.monotonic() + self.config.timeout_s
            self._check_peer(peer, deadline, "a free slot")
            time.sleep(0)
        raw = encode_header(header)
        if len(raw) > _HEADER_MAX:
            raise ConnectorError(f"tensor header of {len(raw)} bytes exceeds the slot's {_HEADER_MAX}")
        at = ring.slot(seq)
        mm = ring.mm
        _U32.pack_into(mm, at + 8, len(raw))
        mm[at + _SLOT_META : at + _SLOT_META + len(raw)] = raw
        pos = at + _SLOT_META + _HEADER_MAX
        end = at + ring.slot_size
        for t in tensors:
            n = t.numel() * t.element_size()
            if pos + n > end:
                raise ConnectorError(
                    f"payload of {header.seq_lens} tokens exceeds the shared-memory slot ({self._slot_data} bytes, "
                    f"sized for max_num_tokens={self.context.max_num_tokens})"
                )
            if n:
                ring.buf[pos : pos + n] = tensor_bytes(t)
            pos += n
        ring.put(at, seq)  # publish last: the reader trusts everything before seq
        ring.next_seq = seq + 1
        ring.put(ring.write_at, seq)
        if _U64.unpack_from(mm, ring.sleep_at)[0]:
            try:
                os.write(ring.fifo, b"\x01")
            except BlockingIOError:
                pass  # the FIFO already holds a wake-up byte: the reader will wake

    def _await(self, ring: _Ring, peer: int, what: Callable[[], str]) -> int:
        """Spin, then block on the doorbell, until the next slot is published; return its offset.

        ``what`` builds the error text only when one is raised.
        """
        seq = ring.next_seq
        at = ring.slot(seq)
        mm = ring.mm
        unpack = _U64.unpack_from
        if unpack(mm, at)[0] == seq:
            return at
        spin_until = time.perf_counter() + self._spin_s
        while time.perf_counter() < spin_until:
            if unpack(mm, at)[0] == seq:
                return at
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            ring.put(ring.sleep_at, 1)
            if unpack(mm, at)[0] == seq:
                ring.put(ring.sleep_at, 0)
                return at
            ready, _, _ = select.select([ring.fifo], [], [], 0.01)
            ring.put(ring.sleep_at, 0)
            if ready:
                try:
                    os.read(ring.fifo, 4096)
                except BlockingIOError:
                    pass  # another wake-up already drained it
            if unpack(mm, at)[0] == seq:
                return at
            self._check_peer(peer, deadline, what())

    def _check_peer(self, peer: int, deadline: float, what: str) -> None:
        pid = self._peer_pids.get(peer)
        if pid:
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat", "rb") as fh:
                    state = fh.read().rsplit(b")", 1)[-1].split()[0]
                if state in (b"Z", b"X"):
                    raise ProcessLookupError
            except ProcessLookupError:
                raise PeerLostError(f"the peer process {pid} exited while this side waited for {what}") from None
            except OSError as exc:
                if exc.errno != errno.EPERM:
                    raise
        if time.monotonic() > deadline:
            raise PeerLostError(f"no {what} from the peer within {self.config.timeout_s:g}s")

    def _read_header(self, ring: _Ring, at: int) -> TensorHeader:
        n = _U32.unpack_from(ring.mm, at + 8)[0]
        if n > _HEADER_MAX:
            raise WireFormatError(f"shared-memory slot announces a {n}-byte header; at most {_HEADER_MAX}")
        return decode_header(ring.mm[at + _SLOT_META : at + _SLOT_META + n])

    def _release(self, ring: _Ring) -> None:
        ring.put(ring.read_at, ring.next_seq)
        ring.next_seq += 1

    def _copy_out(self, ring: _Ring, at: int, header: TensorHeader, targets: list[torch.Tensor]) -> None:
        pos = at + _SLOT_META + _HEADER_MAX
        for spec, dst in zip(header.tensors, targets, strict=True):
            n = nbytes_of(spec)
            if n:
                writable_bytes(dst)[:] = ring.buf[pos : pos + n]
            pos += n

    def _channel(self, peer: int, stage: int) -> _Channel:
        ch = self._channels.get((peer, stage))
        if ch is None:
            self._require_initialized()
            raise ConnectorError(f"stage_idx={stage} is out of range; num_stages={self.config.num_stages}")
        return ch

    # --- attention side ------------------------------------------------------------------

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self._require_role("attention", "send_attn_output")
        ch = self._channel(0, metadata.stage_idx)
        n = self.check_attn_send(hidden_states, metadata)
        self.check_no_send_pending(metadata.stage_idx)
        tensors = [hidden_states, *check_extras(self._extras, extras, n)] if self._extras else [hidden_states]
        names = ("hidden_states", *(e.name for e in self._extras))
        self._write(ch.a2f, tensor_header("a2f", metadata, metadata.seq_lens, names, tensors), tensors, 0)
        self.record_send(metadata, n)

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        self._require_role("attention", "recv_ffn_output")
        ch = self._channel(0, stage_idx)
        layer, _n = self.take_send(stage_idx)
        ring = ch.f2a
        at = self._await(ring, 0, lambda: f"the ffn output of layer {layer}, stage {stage_idx}")
        header = self._read_header(ring, at)
        spec = header.tensors[0] if len(header.tensors) == 1 else None
        if spec is None or (spec.shape, header.layer_idx) != (tuple(ref_tensor.shape), layer):
            self._release(ring)
            raise ConnectorError(f"ffn output {header.tensors} for layer {header.layer_idx}; expected "
                                 f"{list(ref_tensor.shape)} for layer {layer}")  # fmt: skip
        out, _ = self._pool.tensor(("f2a", stage_idx), spec)
        self._copy_out(ring, at, header, [out])
        self._release(ring)
        return out

    # --- ffn side ---------------------------------------------------------------------------

    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        self._require_role("ffn", "recv_attn_output")
        headers = []
        slots = []
        for i in range(len(self._peers)):
            ring = self._channel(i, stage_idx).a2f
            at = self._await(
                ring, i, lambda i=i: f"hidden states of stage {stage_idx} from attention rank {self._peers[i]}"
            )
            h = self._read_header(ring, at)
            if h.kind != "a2f" or h.stage_idx != stage_idx or (headers and h.layer_idx != headers[0].layer_idx):
                self._release(ring)
                raise WireFormatError(f"slot from attention rank {self._peers[i]}: kind={h.kind} stage={h.stage_idx} "
                                      f"layer={h.layer_idx}; expected an a2f for stage {stage_idx}")  # fmt: skip
            headers.append(h)
            slots.append(at)
        seq_lens = tuple(h.seq_lens[0] for h in headers)
        total = sum(seq_lens)
        first = headers[0].tensors
        outs = []
        for t_idx, spec in enumerate(first):
            full = msgspec.structs.replace(spec, shape=(total, *spec.shape[1:]))
            out, _ = self._pool.tensor(("a2f", stage_idx, t_idx), full)
            outs.append(out)
        start = 0
        for i, (h, at) in enumerate(zip(headers, slots, strict=True)):
            n = h.seq_lens[0]
            self._copy_out(self._channel(i, stage_idx).a2f, at, h, [o[start : start + n] for o in outs])
            self._release(self._channel(i, stage_idx).a2f)
            start += n
        extras = {e.name: t for e, t in zip(self._extras, outs[1:], strict=True)} if self._extras else {}
        return A2FPayload(outs[0], TransferMetadata(headers[0].layer_idx, stage_idx, seq_lens), extras)

    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        self._require_role("ffn", "send_ffn_output")
        self.check_ffn_send(output, metadata, len(self._peers))
        start = 0
        for i, n in enumerate(metadata.seq_lens):
            chunk = output[start : start + n]
            start += n
            header = tensor_header("f2a", metadata, (n,), ("ffn_output",), (chunk,))
            self._write(self._channel(i, metadata.stage_idx).f2a, header, [chunk], i)
