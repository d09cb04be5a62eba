"""``ShmAFDConnector`` (alias ``shm``): same-host shared-memory transport.

Per attention peer and stage, the FFN rank creates one segment in
``/dev/shm`` holding two rings (attention→FFN and FFN→attention) of ``slots``
slots each. A slot is one 64-byte meta line (``seq``, layer, stage, tokens,
tensor count, one dtype code per tensor) followed by the tensors, each
64-byte aligned; shapes follow from the model (``[tokens, hidden]`` and the
declared extras), so no per-message header is encoded or decoded.

Each ring has two counters on their own cache lines: ``published`` (the last
slot the writer filled) and ``released`` (the last slot the reader freed),
each with a sleep flag for its waiter. The writer copies every tensor once
into the slot and then publishes; the reader spins on ``published`` (at
least ``spin_us``, adapted up to ``spin_max_us`` by :mod:`afd_connectors.shm.spin`)
and then blocks on a futex on it, and the writer calls
``FUTEX_WAKE`` only when the reader has flagged itself asleep — so an idle
side burns no core and a busy one makes no system call. With ``in_place``
(default) the reader returns a view of the slot, reserved until its next
receive on that stage; otherwise, and for fan-in, it copies the tensor out
once (fan-in: straight into its part of the concatenated buffer).

The counters, the doorbell, the slot meta line and the copies are the native
module :mod:`afd_connectors.shm._shmring` (built by pip from ``_shmring.c``); per
message Python makes two or three native calls and, in steady state, builds
no objects. Where :mod:`afd_connectors.shm._shmsteady` is built (a torch
extension), the steady state of each contract call is one C++ call: the same
checks on the same ring, with every first receive, every error and every wait
longer than one futex slice left to the Python path below it.

Segments are unlinked by the FFN rank as soon as every attention peer has
attached, so nothing is left in ``/dev/shm`` after a crash of either side;
open mappings keep working. Liveness of the peer is checked through its PID
(recorded in the segment) while waiting; handshake, per-step control and
goodbye go through :class:`~afd_sdk.control.ZmqControlPlane`.
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
import os
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, ClassVar

import msgspec
import torch

from afd_connectors import native
from afd_connectors.shm.spin import AdaptiveSpin, default_spin_max_us
from afd_sdk.connector import AFDConnector, ConnectorCapabilities, ConnectorContext
from afd_sdk.control import PLAN_CACHE_LIMIT, PlanCache, ZmqControlPlane
from afd_sdk.errors import AFDConfigError, ConnectorError, PeerLostError, WireFormatError
from afd_sdk.topology import FFNFirstWorld
from afd_sdk.wire import COMMON_DTYPES, A2FPayload, TransferMetadata, dtype_from_name

_shmring, _NATIVE_MISSING = native.load("shm._shmring")  # without it: reported at config validation
_shmsteady, _STEADY_MISSING = native.load("shm._shmsteady")  # without it Python runs the steady state

logger = logging.getLogger(__name__)

__all__ = ["ShmAFDConnector", "ShmExtraConfig"]

_LINE = 64  # fields two processes write live on separate cache lines
# segment header (offsets)
_ATTACHED = 0  # u64: attention peer's pid once it mapped the segment
_FFN_PID = _LINE
# the ring geometry, written by the FFN side (the creator) before any peer attaches: the attention side maps the
# rings where they are, whatever its own max_num_tokens would have made of them (vLLM engines size theirs from
# their own max_num_batched_tokens)
_LAYOUT_SLOTS = _LINE + 8
_LAYOUT_SLOT_SIZE = _LINE + 16
_LAYOUT_SLOT_DATA = _LINE + 24
_RINGS_AT = 2 * _LINE  # two ring control blocks follow, 4 lines each
_PUBLISHED, _RELEASED, _READER_ASLEEP, _WRITER_ASLEEP = 0, _LINE, 2 * _LINE, 3 * _LINE
_DATA_AT = _RINGS_AT + 8 * _LINE
# slot meta line (written and read by _shmring, struct slot_meta): seq u64, layer i32, stage i32,
# tokens u32, tensor count u32, dtype codes u8[40]; Python writes only the codes after the first
_CODES_AT = 24
_MAX_TENSORS = _LINE - _CODES_AT
_BLOCK_NS = 20_000_000  # one futex slice; between slices the waiter checks its peer and deadline

# dtype <-> one-byte code (the order of the sorted names; both sides run the same build)
_CODE_NAMES = tuple(sorted(COMMON_DTYPES))
_CODE_OF: dict[torch.dtype, int] = {dtype_from_name(n): i for i, n in enumerate(_CODE_NAMES)}
_DTYPE_OF: tuple[torch.dtype, ...] = tuple(dtype_from_name(n) for n in _CODE_NAMES)
_NUM_CODES = len(_CODE_NAMES)


def _aligned(n: int) -> int:
    return -(-n // _LINE) * _LINE


def _peers_bound(context: ConnectorContext) -> int:
    """Most attention peers one FFN rank can serve (its fan-in buffers hold that many slots)."""
    cfg = context.config
    return max(1, -(-cfg.num_attention_ranks // cfg.num_ffn_ranks))


class ShmExtraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``connector_extra_config`` of ``ShmAFDConnector``.

    * ``slots``: slots per ring (default 2).
    * ``spin_us``: the least a waiting side spins before blocking on the futex (default 100). It should
      outlast the host's futex wake-up: when a wake-up takes longer than the peer's spin, the peer is
      asleep by the time the answer comes, so every round trip pays two wake-ups and stays that way
      (measured on a 2-vCPU VM, wake-ups of 60-95 us: with 50, whole benchmark blocks ran at 120-190 us
      per 64 KiB round trip instead of ~5).
    * ``spin_max_us``: the most the spin adapts to (at least ``spin_us``; equal: a fixed spin). A wait
      that slept and still ended within it raises the spin to cover such a wait next time; a longer one
      puts it back to ``spin_us``. Left out: 1000 where this process may run on 4 cores or more, else
      ``spin_us`` — a spin that covers a peer computing on CPU takes the core it computes on when cores
      are shared (:func:`afd_connectors.shm.spin.default_spin_max_us`).
    * ``shm_dir``: where segments live (default ``/dev/shm``).
    * ``in_place``: receive without copying (default true): ``recv_ffn_output`` and, for an FFN
      rank with one attention peer, ``recv_attn_output`` return views of the shared slot, which
      stays reserved until the next receive on the same stage — the same lifetime as another
      connector's reused receive buffer. False: one copy out of the slot into such a buffer.
    """

    slots: int = 2
    spin_us: Annotated[float, msgspec.Meta(ge=0, le=1_000_000)] = 100.0
    spin_max_us: Annotated[float, msgspec.Meta(ge=0, le=1_000_000)] | None = None
    shm_dir: str = "/dev/shm"
    in_place: bool = True

    def spin_range(self) -> tuple[float, float]:
        """``(spin_us, spin_max_us)`` with an unset ``spin_max_us`` resolved for this host."""
        top = default_spin_max_us(self.spin_us) if self.spin_max_us is None else self.spin_max_us
        return self.spin_us, top


class _Ring:
    """One direction of one segment: addresses of its counters and slots, and the local cursor."""

    __slots__ = (
        "base",
        "held",
        "next_seq",
        "plans",
        "published",
        "reader_asleep",
        "reader_waits_for",
        "released",
        "slot_size",
        "slots",
        "slots_at",
        "tensors",
        "writer_asleep",
        "writer_waits_for",
    )

    def __init__(self, base: int, control_at: int, slots_at: int, slots: int, slot_size: int) -> None:
        self.base = base
        self.published = base + control_at + _PUBLISHED
        self.released = base + control_at + _RELEASED
        self.reader_asleep = base + control_at + _READER_ASLEEP
        self.writer_asleep = base + control_at + _WRITER_ASLEEP
        self.slots_at = slots_at
        self.slots = slots
        self.slot_size = slot_size
        self.next_seq = 1  # writer: next seq to publish; reader: next seq to consume
        self.held = 0  # reader with in_place: the seq whose slot the caller still reads
        self.tensors = 1  # tensors per slot: hidden states (or ffn output) plus, attention->FFN, the extras
        self.plans: PlanCache[tuple[int, ...], tuple] = PlanCache()  # reader: receive results (``_receive_plan``)
        self.reader_waits_for, self.writer_waits_for = "the next slot", "a free slot"  # named per ring at init


class _Channel:
    """Both rings of one (attention peer, stage) segment, seen from one side."""

    def __init__(
        self, path: str, size: int, create: bool, slots: int, slot_size: int, slot_data: int, num_extras: int
    ) -> None:
        """Create the segment (FFN side, with this geometry) or attach to it (attention side, with the creator's).

        Attaching checks that the creator's slots hold ``slot_data`` bytes, what this side may write.
        """
        self.path = path
        self.mm: mmap.mmap | None = None
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
            except OSError:
                os.close(fd)
                raise
        else:
            fd = os.open(path, os.O_RDWR)
            size = os.fstat(fd).st_size
        try:
            if size < _DATA_AT:
                raise ConnectorError(f"shared-memory segment {path} has {size} bytes; not an afd-sdk segment")
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if create:
            self.put_u64(_LAYOUT_SLOTS, slots)
            self.put_u64(_LAYOUT_SLOT_SIZE, slot_size)
            self.put_u64(_LAYOUT_SLOT_DATA, slot_data)
        else:
            theirs = (self.get_u64(_LAYOUT_SLOTS), self.get_u64(_LAYOUT_SLOT_SIZE), self.get_u64(_LAYOUT_SLOT_DATA))
            problem = None
            if theirs[0] < 1 or theirs[1] < _LINE + theirs[2] or _DATA_AT + 2 * theirs[0] * theirs[1] > size:
                problem = (
                    f"shared-memory segment {path} ({size} bytes) holds no valid ring layout (slots={theirs[0]}, "
                    f"slot_size={theirs[1]}, slot_data={theirs[2]}); expected one written by the FFN side of "
                    "this afd-sdk version"
                )
            elif theirs[2] < slot_data:
                problem = (
                    f"shared-memory segment {path}: the FFN rank made slots of {theirs[2]} bytes, this attention "
                    f"rank may send {slot_data} per exchange (its max_num_tokens); expected the FFN side sized "
                    "for at least as many tokens per exchange (afd ffn serve --engine vllm takes vLLM's "
                    "max_num_batched_tokens for the model: give the attention engines no more than that)"
                )
            if problem is not None:
                self.mm.close()
                self.mm = None
                raise ConnectorError(problem)
            slots, slot_size = theirs[0], theirs[1]
        # one byte tensor over the mapping: its address for the native calls, its slices for in-place views
        self.segment: torch.Tensor | None = torch.frombuffer(self.mm, dtype=torch.uint8)
        base = self.segment.data_ptr()
        ring_bytes = slots * slot_size
        self.a2f = _Ring(base, _RINGS_AT, _DATA_AT, slots, slot_size)
        self.a2f.tensors = 1 + num_extras
        self.f2a = _Ring(base, _RINGS_AT + 4 * _LINE, _DATA_AT + ring_bytes, slots, slot_size)

    def put_u64(self, at: int, value: int) -> None:
        struct.pack_into("<Q", self.mm, at, value)  # type: ignore[arg-type]

    def get_u64(self, at: int) -> int:
        return struct.unpack_from("<Q", self.mm, at)[0]  # type: ignore[arg-type]

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass  # already unlinked (the FFN side does it once every peer attached)

    def close(self) -> None:
        if self.mm is None:
            return
        self.a2f.plans.clear()
        self.f2a.plans.clear()
        self.segment = None
        try:
            self.mm.close()
        except BufferError as exc:  # a caller still holds an in-place view; the mapping goes with it
            logger.debug("shared-memory segment %s stays mapped until its last view is gone: %s", self.path, exc)
        self.mm = None


class _Landing:
    """Receive buffers of a fixed capacity per key (allocated on first use, never moved)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._bufs: dict[object, torch.Tensor] = {}

    def view(self, key: object, code: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``shape`` and dtype ``code`` at the start of the key's buffer."""
        dtype = _DTYPE_OF[code]
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self._capacity:
            raise ConnectorError(
                f"a received {dtype}{list(shape)} needs {nbytes} bytes; the receive buffers hold "
                f"{self._capacity} (sized from max_num_tokens)"
            )
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = torch.empty(self._capacity, dtype=torch.uint8)
        return buf[:nbytes].view(dtype).view(shape)

    def clear(self) -> None:
        self._bufs.clear()


class ShmAFDConnector(AFDConnector):
    """Shared-memory transport for Attention and FFN ranks on one host (any A ≥ F)."""

    name = "ShmAFDConnector"
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities(
        devices=frozenset({"cpu"}),
        world_layout="ffn_first",
        attention_lt_ffn=False,
        supports_extras=True,
        dtypes=COMMON_DTYPES,
        same_host_only=True,
    )
    extra_config_schema = ShmExtraConfig
    raw_baselines: ClassVar[Mapping[str, str | None]] = {
        "gloo": None,
        "zmq": None,
        "shm": "afd_connectors.shm.raw:RawShm",
        "memcpy": None,
    }

    @classmethod
    def native_modules(cls) -> Mapping[str, str | None]:
        return native.problems("shm._shmring", "shm._shmsteady")

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
        parsed = cls.parse_extra_config(extra)  # the schema's types and defaults (wrong types raise here)
        assert isinstance(parsed, ShmExtraConfig)
        if parsed.spin_max_us is not None and parsed.spin_max_us < parsed.spin_us:
            raise AFDConfigError(
                f"afd.connector_extra_config.spin_max_us={parsed.spin_max_us!r} is invalid with "
                f"spin_us={parsed.spin_us!r}; expected spin_max_us >= spin_us (equal: a fixed spin)",
                key="afd.connector_extra_config.spin_max_us",
                value=parsed.spin_max_us,
            )
        if extra.get("in_place", True) and int(extra.get("slots", 2)) < 2:
            raise AFDConfigError(
                f"afd.connector_extra_config.slots={extra.get('slots')!r} is invalid with in_place=true; expected "
                "slots >= 2 (an in-place view keeps its slot until the next receive), or in_place=false",
                key="afd.connector_extra_config.slots",
                value=extra.get("slots"),
            )
        hosts = {"host": config.host}  # type: ignore[attr-defined]
        for f, ffn_host in enumerate(config.ffn_hosts or ()):  # type: ignore[attr-defined]
            hosts[f"ffn_hosts[{f}]"] = ffn_host
        for key, host in hosts.items():
            if host not in ("127.0.0.1", "localhost", "::1"):
                raise AFDConfigError(
                    f"afd.{key}={host!r} is invalid for ShmAFDConnector; expected a loopback address (same host only)",
                    key=f"afd.{key}",
                    value=host,
                )
        if _NATIVE_MISSING is not None:
            raise AFDConfigError(
                f"afd.connector={cls.name!r} needs its native module: {_NATIVE_MISSING}; expected an installed "
                "afd-sdk (pip install builds it with a C compiler), or another connector",
                key="afd.connector",
                value=cls.name,
            )

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self._stage_rings: list[list[_Channel]] = []  # stage -> channels, one per attention peer in fan-in order
        self._peers: tuple[int, ...] = ()
        self._peer_pids: dict[int, int] = {}
        self._extras = context.ffn_extras
        self._extra_codes = tuple(_CODE_OF[dtype_from_name(e.dtype)] for e in self._extras)
        self._extra_trailing = tuple(tuple(e.trailing_shape) for e in self._extras)
        self._hidden = context.model.hidden_size
        itemsize = dtype_from_name(context.model.dtype).itemsize
        extra_row = sum(dtype_from_name(e.dtype).itemsize * math.prod(e.trailing_shape) for e in self._extras)
        if 1 + len(self._extras) > _MAX_TENSORS:
            raise ConnectorError(
                f"{len(self._extras)} declared extras; a shared-memory slot carries at most {_MAX_TENSORS - 1}"
            )
        # a slot carries one peer's tokens (A->F) or one peer's share of the output (F->A)
        tokens = context.max_num_tokens
        self._slot_data = max(4096, tokens * (self._hidden * itemsize + extra_row) + _LINE * (1 + len(self._extras)))
        self._slot_size = _aligned(_LINE + self._slot_data)
        self._landing = _Landing(self._slot_data * _peers_bound(context))
        self._spin = AdaptiveSpin(*self.extra.spin_range())
        self._spin_at = self._spin.address  # read per wait
        self._in_place = bool(self.extra.in_place)
        self._steady: _shmsteady.ShmSteady | None = None  # one peer per stage, where the C++ module is built

    # --- names and lifecycle -------------------------------------------------------

    def _segment_size(self) -> int:
        return _DATA_AT + 2 * self.extra.slots * self._slot_size

    def _path(self, attention_rank: int, stage: int) -> str:
        """``<shm_dir>/afd-<port>-a<rank>-s<stage>`` (unique per world and pair)."""
        return os.path.join(self.extra.shm_dir, f"afd-{self.config.port}-a{attention_rank}-s{stage}")

    def open(self) -> None:
        if not os.path.isdir(self.extra.shm_dir):
            raise ConnectorError(f"shared-memory directory {self.extra.shm_dir!r} does not exist")
        cfg = self.config
        control = ZmqControlPlane(self.context, connector_name=self.name)
        world = self.world
        assert isinstance(world, FFNFirstWorld)
        size = self._segment_size()
        slots = self.extra.slots
        if self.role == "ffn":
            self._peers = world.attention_for_ffn(self.role_rank)
            for s in range(cfg.num_stages):
                self._stage_rings.append([])
                for a in self._peers:
                    path = self._path(a, s)
                    self._remove_stale(path)
                    ch = _Channel(path, size, True, slots, self._slot_size, self._slot_data, len(self._extras))
                    ch.put_u64(_FFN_PID, os.getpid())
                    ch.a2f.reader_waits_for = f"hidden states of stage {s} from attention rank {a}"
                    ch.f2a.writer_waits_for = f"a free output slot of stage {s} (attention rank {a} reads slowly)"
                    self._stage_rings[s].append(ch)
            self.attach_control_plane(control)
            self._wait_attached()
        else:
            self.attach_control_plane(control)
            self._peers = (world.ffn_for_attention(self.role_rank),)
            for s in range(cfg.num_stages):
                path = self._path(self.role_rank, s)
                try:
                    ch = _Channel(path, size, False, slots, self._slot_size, self._slot_data, len(self._extras))
                except FileNotFoundError as exc:
                    raise ConnectorError(
                        f"shared-memory segment {path} is missing: ShmAFDConnector needs both roles on one host "
                        f"with the same shm_dir ({self.extra.shm_dir})"
                    ) from exc
                ch.put_u64(_ATTACHED, os.getpid())
                ffn = self._peers[0]
                ch.f2a.reader_waits_for = f"the ffn output of stage {s} from ffn rank {ffn}"
                ch.a2f.writer_waits_for = f"a free slot of stage {s} (ffn rank {ffn} reads slowly)"
                self._peer_pids[0] = ch.get_u64(_FFN_PID)
                self._stage_rings.append([ch])
        self._steady = self._make_steady()

    def _make_steady(self) -> _shmsteady.ShmSteady | None:
        """The C++ steady state over the open channels: one attention peer per stage, where it is built."""
        if _shmsteady is None:
            logger.debug("ShmAFDConnector runs its steady state in Python: %s", _STEADY_MISSING)
            return None
        if len(self._peers) != 1:
            return None
        rings = [(channels[0].a2f, channels[0].f2a) for channels in self._stage_rings]
        return _shmsteady.ShmSteady(
            self.role == "attention",
            rings,
            self._hidden,
            self.sends,
            list(_DTYPE_OF),
            self._slot_data,
            self._spin_at,
            _BLOCK_NS,
            self._in_place,
            PLAN_CACHE_LIMIT,
        )

    def _remove_stale(self, path: str) -> None:
        """A segment left by a process that died before its peers attached (the only leak window)."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return

    def _wait_attached(self) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        for channels in self._stage_rings:
            for i, ch in enumerate(channels):  # i: the attention peer's index in fan-in order
                while True:
                    pid = ch.get_u64(_ATTACHED)
                    if pid:
                        self._peer_pids[i] = pid
                        break
                    if time.monotonic() > deadline:
                        raise PeerLostError(
                            f"attention peer {self._peers[i]} did not attach {ch.path} within "
                            f"{self.config.timeout_s:g}s"
                        )
                    time.sleep(0.0005)
                ch.unlink()  # mapped by both: from now on nothing can be left behind in the directory

    def release(self) -> None:
        steady, self._steady = self._steady, None
        if steady is not None:
            steady.clear()  # its plans hold views of the segments closed below
        for ch in (ch for channels in self._stage_rings for ch in channels):
            if self.role == "ffn":
                ch.unlink()
            ch.close()
        self._stage_rings = []
        self._landing.clear()
        self._peer_pids = {}

    # --- ring operations (hot path: no closures, no per-message objects beyond the results) -------

    def _wait(self, counter: int, want: int, asleep: int, peer: int, what: str) -> None:
        """Until the u64 at ``counter`` reaches ``want``: spin, then futex slices with peer/deadline checks."""
        if _shmring.wait_ge(counter, want, asleep, self._spin_at, _BLOCK_NS):
            return
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            self._check_peer(peer, deadline, what)
            if _shmring.wait_ge(counter, want, asleep, 0, _BLOCK_NS):
                return

    def _write(
        self, ch: _Channel, ring: _Ring, layer: int, stage: int, tokens: int, tensors: Sequence[torch.Tensor], peer: int
    ) -> None:
        """Copy ``tensors`` into the ring's next slot and publish it (waiting for a free slot if needed).

        Extras (if any) are copied here; the first tensor's copy, the meta line and the publish are one
        native call, which reports a slot still being read instead of writing it.
        """
        seq = ring.next_seq
        free_at = seq - ring.slots
        slot = ring.base + ring.slots_at + ((seq - 1) % ring.slots) * ring.slot_size
        first = tensors[0]
        code = _CODE_OF.get(first.dtype)
        if code is None or not first.is_cpu:
            raise self._unsupported(first)
        if not first.is_contiguous():
            first = first.contiguous()
        if len(tensors) > 1:
            self._write_extras(ch, ring, slot, free_at, first.nbytes, tensors[1:], tokens, peer)
        nbytes = first.nbytes
        if nbytes > self._slot_data:
            raise self._too_big(tokens)
        while not _shmring.write_slot(
            ring.released,
            free_at,
            slot,
            seq,
            first.data_ptr(),
            nbytes,
            layer,
            stage,
            tokens,
            len(tensors),
            code,
            ring.published,
            ring.reader_asleep,
        ):
            self._wait(ring.released, free_at, ring.writer_asleep, peer, ring.writer_waits_for)
        ring.next_seq = seq + 1

    def _write_extras(
        self,
        ch: _Channel,
        ring: _Ring,
        slot: int,
        free_at: int,
        first_nbytes: int,
        extras: Sequence[torch.Tensor],
        tokens: int,
        peer: int,
    ) -> None:
        """Copy the extras behind the first tensor and record their dtype codes (the slot must be free first)."""
        if _shmring.load(ring.released) < free_at:
            self._wait(ring.released, free_at, ring.writer_asleep, peer, ring.writer_waits_for)
        pos = slot + _LINE + _aligned(first_nbytes)
        codes = []
        for t in extras:
            code = _CODE_OF.get(t.dtype)
            if code is None or not t.is_cpu:
                raise self._unsupported(t)
            if not t.is_contiguous():
                t = t.contiguous()
            if pos + t.nbytes > slot + ring.slot_size:
                raise self._too_big(tokens)
            _shmring.copy(pos, t.data_ptr(), t.nbytes)
            pos += _aligned(t.nbytes)
            codes.append(code)
        at = slot - ring.base + _CODES_AT + 1
        ch.mm[at : at + len(codes)] = bytes(codes)  # type: ignore[index]

    @staticmethod
    def _unsupported(t: torch.Tensor) -> ConnectorError:
        return ConnectorError(
            f"a {t.dtype} tensor on {t.device}; ShmAFDConnector carries CPU tensors of {', '.join(_CODE_NAMES)}"
        )

    def _too_big(self, tokens: int) -> ConnectorError:
        return ConnectorError(
            f"payload of {tokens} tokens exceeds the shared-memory slot ({self._slot_data} bytes, "
            f"sized for max_num_tokens={self.context.max_num_tokens})"
        )

    def _await(self, ch: _Channel, ring: _Ring, peer: int) -> tuple[int, int, int, int, int]:
        """Wait for the ring's next slot; return ``(offset, layer, stage, tokens, first dtype code)``."""
        if ring.held:  # the previous in-place view's lifetime ends here
            self._release(ring)
        seq = ring.next_seq
        at = ring.slots_at + ((seq - 1) % ring.slots) * ring.slot_size
        meta = _shmring.recv_slot(ring.published, seq, ring.reader_asleep, self._spin_at, _BLOCK_NS, ring.base + at)
        if meta is None:
            self._wait(ring.published, seq, ring.reader_asleep, peer, ring.reader_waits_for)
            meta = _shmring.recv_slot(ring.published, seq, ring.reader_asleep, 0, 0, ring.base + at)
        got, layer, stage, tokens, count, code = meta
        if got != seq or code >= _NUM_CODES or count != ring.tensors:
            self._release(ring)
            raise WireFormatError(
                f"shared-memory slot {ch.path}: seq={got} tensors={count} dtype code={code}; "
                f"expected seq={seq} with {ring.tensors} tensors"
            )
        return at, layer, stage, tokens, code

    def _release(self, ring: _Ring) -> None:
        """Free the slot read last (after its copy, or when the in-place view's lifetime ends)."""
        seq = ring.next_seq
        ring.next_seq = seq + 1
        ring.held = 0
        _shmring.publish(ring.released, seq, ring.writer_asleep)

    def _finish_read(self, ring: _Ring) -> None:
        """After a receive's copies: free the slot, or with ``in_place`` keep it for the returned views."""
        if self._in_place:
            ring.held = ring.next_seq
        else:
            self._release(ring)

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

    def _receive_plan(
        self, ch: _Channel, ring: _Ring, at: int, key: object, shapes: Sequence[tuple[int, int, tuple[int, ...]]]
    ) -> tuple[list[torch.Tensor], tuple[tuple[int, int, int], ...]]:
        """Tensors a receive of slot ``at`` returns and the copies that fill them, for ``(index, code, shape)``.

        With ``in_place`` the tensors are views of the slot and there is nothing to copy; otherwise they
        are landing buffers under ``key`` and each copy is ``(dst address, src address, nbytes)``.
        The result is cached per ring (see ``_Ring.plans``): decode repeats the same (slot, layer,
        tokens, dtype), so steady state builds nothing.
        """
        outs: list[torch.Tensor] = []
        copies = []
        pos = at + _LINE
        for idx, code, shape in shapes:
            if self._in_place:
                dtype = _DTYPE_OF[code]
                t = ch.segment[pos : pos + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)  # type: ignore[index]
            else:
                t = self._landing.view((key, idx), code, shape)
                if t.nbytes:
                    copies.append((t.data_ptr(), ring.base + pos, t.nbytes))
            outs.append(t)
            pos += _aligned(t.nbytes)
        return outs, tuple(copies)

    def _stage(self, stage: int) -> list[_Channel]:
        self.check_stage(stage)
        return self._stage_rings[stage]

    # --- attention side ------------------------------------------------------------------

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        steady = self._steady  # the C++ steady state: the checks below, then the write
        if steady is not None and extras is None and steady.attn_send(hidden_states, metadata):
            return
        if self.role != "attention":
            self.require_role("attention", "send_attn_output")
        stage = metadata.stage_idx
        (ch,) = self._stage(stage)
        n = self.check_attn_send(hidden_states, metadata)
        if stage in self.sends:
            self.check_no_send_pending(stage)
        tensors = [hidden_states, *self.check_extras(extras, n)] if self._extras else (hidden_states,)
        self._write(ch, ch.a2f, metadata.layer_idx, stage, n, tensors, 0)
        self.sends[stage] = (metadata.layer_idx, n)

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        steady = self._steady  # the C++ steady state: the output, or None (served below)
        if steady is not None:
            out = steady.attn_recv(ref_tensor, stage_idx)
            if out is not None:
                return out
        if self.role != "attention":
            self.require_role("attention", "recv_ffn_output")
        (ch,) = self._stage(stage_idx)
        sent = self.sends.pop(stage_idx, None)
        layer, n = sent if sent is not None else self.take_send(stage_idx)  # take_send raises the error
        ring = ch.f2a
        at, got_layer, _stage, tokens, code = self._await(ch, ring, 0)
        if got_layer != layer or tokens != n:
            self._release(ring)
            raise ConnectorError(
                f"ffn output of {tokens} tokens for layer {got_layer}; expected {n} tokens for layer {layer}"
            )
        key = (at, n, code)
        plan = ring.plans.get(key)
        if plan is None:
            outs, copies = self._receive_plan(ch, ring, at, ("f2a", stage_idx), ((0, code, (n, self._hidden)),))
            plan = ring.plans.remember(key, (outs[0], copies))
            if steady is not None:
                steady.remember_f2a(stage_idx, at, n, code, outs[0], copies)
        for dst, src, nbytes in plan[1]:
            _shmring.copy(dst, src, nbytes)
        self._finish_read(ring)
        return plan[0]

    # --- ffn side ---------------------------------------------------------------------------

    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        steady = self._steady  # the C++ steady state (one peer): the payload, or None (served below)
        if steady is not None:
            payload = steady.ffn_recv(stage_idx)
            if payload is not None:
                return payload
        if self.role != "ffn":
            self.require_role("ffn", "recv_attn_output")
        channels = self._stage(stage_idx)
        if len(channels) == 1:
            return self._recv_one(channels[0], stage_idx)
        slots = []
        for i, ch in enumerate(channels):
            slot = self._await(ch, ch.a2f, i)
            self._check_a2f(ch, slot, stage_idx, slots[0][1] if slots else None)
            slots.append(slot)
        seq_lens = tuple(s[3] for s in slots)
        total = sum(seq_lens)
        codes = (slots[0][4], *self._extra_codes)
        shapes = ((total, self._hidden), *((total, *trail) for trail in self._extra_trailing))
        landing = self._landing
        outs = [landing.view(("a2f", stage_idx, k), c, sh) for k, (c, sh) in enumerate(zip(codes, shapes, strict=True))]
        start = 0
        for ch, (at, _layer, _stage, n, code) in zip(channels, slots, strict=True):
            if code != codes[0]:
                self._release(ch.a2f)
                raise WireFormatError(
                    f"attention peers sent {_DTYPE_OF[codes[0]]} and {_DTYPE_OF[code]} hidden states for one stage"
                )
            pos = ch.a2f.base + at + _LINE
            for out in outs:
                row = out.nbytes // total if total else 0
                _shmring.copy(out.data_ptr() + start * row, pos, n * row)
                pos += _aligned(n * row)
            self._release(ch.a2f)
            start += n
        extras = {e.name: t for e, t in zip(self._extras, outs[1:], strict=True)} if self._extras else {}
        return A2FPayload(outs[0], TransferMetadata(slots[0][1], stage_idx, seq_lens), extras)

    def _check_a2f(self, ch: _Channel, slot: tuple[int, int, int, int, int], stage: int, layer: int | None) -> None:
        _at, got_layer, got_stage, _n, _code = slot
        if got_stage != stage or (layer is not None and got_layer != layer):
            self._release(ch.a2f)
            raise WireFormatError(
                f"slot from {ch.path}: stage={got_stage} layer={got_layer}; expected stage "
                f"{stage}" + (f", layer {layer}" if layer is not None else "")
            )

    def _recv_one(self, ch: _Channel, stage_idx: int) -> A2FPayload:
        """Single attention peer: no concatenation, so ``in_place`` can hand out the slot itself.

        The payload object is cached with its plan: it is immutable and, in steady state, only the
        bytes under its tensors change.
        """
        ring = ch.a2f
        slot = self._await(ch, ring, 0)
        at, layer, got_stage, n, code = slot
        if got_stage != stage_idx:
            self._check_a2f(ch, slot, stage_idx, None)
        key = (at, layer, n, code)
        plan = ring.plans.get(key)
        if plan is None:
            shapes = [(0, code, (n, self._hidden))]
            extra = zip(self._extra_codes, self._extra_trailing, strict=True)
            shapes += [(k + 1, c, (n, *t)) for k, (c, t) in enumerate(extra)]
            outs, copies = self._receive_plan(ch, ring, at, ("a2f", stage_idx), shapes)
            extras = {e.name: t for e, t in zip(self._extras, outs[1:], strict=True)}
            plan = ring.plans.remember(
                key, (A2FPayload(outs[0], TransferMetadata(layer, stage_idx, (n,)), extras), copies)
            )
            if self._steady is not None:
                self._steady.remember_a2f(stage_idx, at, layer, n, code, plan[0], copies)
        for dst, src, nbytes in plan[1]:
            _shmring.copy(dst, src, nbytes)
        self._finish_read(ring)
        return plan[0]

    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        steady = self._steady  # the C++ steady state (one peer): the checks below, then the write
        if steady is not None and steady.ffn_send(output, metadata):
            return
        if self.role != "ffn":
            self.require_role("ffn", "send_ffn_output")
        channels = self._stage(metadata.stage_idx)
        self.check_ffn_send(output, metadata, len(channels))
        if len(channels) == 1:
            ch = channels[0]
            self._write(ch, ch.f2a, metadata.layer_idx, metadata.stage_idx, metadata.seq_lens[0], (output,), 0)
            return
        start = 0
        for i, (ch, n) in enumerate(zip(channels, metadata.seq_lens, strict=True)):
            self._write(ch, ch.f2a, metadata.layer_idx, metadata.stage_idx, n, (output[start : start + n],), i)
            start += n
