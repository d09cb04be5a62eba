"""What crosses the wire between the two roles.

Control messages are msgspec structs encoded as msgpack with strict decoding;
tensors travel as raw buffers behind a typed :class:`TensorHeader`. Nothing
here pickles. Malformed bytes raise :class:`~afd_sdk.errors.WireFormatError`
and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from afd_sdk.errors import WireFormatError

if TYPE_CHECKING:
    import torch

__all__ = [
    "COMMON_DTYPES",
    "PROTOCOL_VERSION",
    "WIRE_DTYPES",
    "A2FPayload",
    "ControlMessage",
    "ControlPayload",
    "F2APayload",
    "Goodbye",
    "HandshakeReject",
    "Heartbeat",
    "Hello",
    "ModelFingerprint",
    "TensorHeader",
    "TransferMetadata",
    "decode_control",
    "decode_header",
    "dtype_from_name",
    "dtype_to_name",
    "encode_control",
    "encode_header",
]

#: Bumped whenever a wire struct changes incompatibly; checked at handshake. 2: ``ControlPayload.resume_layers``
#: (an FFN side that dropped the field would replay a failed-over step from layer 0)
PROTOCOL_VERSION = 2


class TransferMetadata(msgspec.Struct, frozen=True, array_like=True):
    """Which layer and stage a tensor belongs to and how its tokens split.

    ``seq_lens`` lists token counts per attention peer in the FFN's fan-in
    order; on the Attention side it has one entry (this rank's tokens).
    """

    layer_idx: int
    stage_idx: int
    seq_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.layer_idx < 0:
            raise WireFormatError(f"TransferMetadata.layer_idx={self.layer_idx}; expected an int >= 0")
        if self.stage_idx < 0:
            raise WireFormatError(f"TransferMetadata.stage_idx={self.stage_idx}; expected an int >= 0")
        if not self.seq_lens or min(self.seq_lens) < 0:
            raise WireFormatError(
                f"TransferMetadata.seq_lens={self.seq_lens!r}; expected a non-empty tuple of ints >= 0"
            )

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)


class ControlPayload(msgspec.Struct, frozen=True, tag="control"):
    """What FFN must know before a step: sent once per step by each Attention rank.

    ``stage_token_counts[s][r]`` is the number of tokens attention peer ``r``
    sends in stage ``s`` (after a control plane merges its peers' payloads, ``r``
    runs over the FFN rank's peers in fan-in order). ``num_layers`` is how many
    layer exchanges follow per stage. ``resume_layers`` (one per stage, empty
    for a whole step) re-announces a step after a failover: stage ``s``'s
    exchanges start at layer ``resume_layers[s]`` on the new FFN replica.
    """

    step_idx: int
    stage_token_counts: tuple[tuple[int, ...], ...]
    max_num_tokens: int
    num_layers: int
    is_warmup: bool = False
    is_graph_capturing: bool = False
    resume_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.step_idx < 0 or self.max_num_tokens < 0 or self.num_layers < 0:
            raise WireFormatError(
                f"ControlPayload(step_idx={self.step_idx}, max_num_tokens={self.max_num_tokens}, "
                f"num_layers={self.num_layers}); expected ints >= 0"
            )
        if not self.stage_token_counts:
            raise WireFormatError("ControlPayload.stage_token_counts is empty; expected one entry per stage")
        for stage in self.stage_token_counts:
            if not stage or any(n < 0 for n in stage):
                raise WireFormatError(
                    f"ControlPayload.stage_token_counts={self.stage_token_counts!r}; "
                    "expected per-stage non-empty tuples of ints >= 0"
                )
        resume = self.resume_layers
        if resume and (
            len(resume) != len(self.stage_token_counts) or any(not 0 <= r <= self.num_layers for r in resume)
        ):
            raise WireFormatError(
                f"ControlPayload.resume_layers={resume!r}; expected one layer in [0, {self.num_layers}] per stage "
                f"({len(self.stage_token_counts)}), or () for a whole step"
            )

    @property
    def num_stages(self) -> int:
        return len(self.stage_token_counts)


class ModelFingerprint(msgspec.Struct, frozen=True):
    """What both roles must agree on about the model; compared at handshake."""

    architecture: str
    hidden_size: int
    dtype: str
    num_layers: int
    adapter: str = ""
    adapter_version: str = ""


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """First message of each side at rendezvous; every field is compared."""

    protocol_version: int
    role: str
    role_rank: int
    num_attention_ranks: int
    num_ffn_ranks: int
    connector: str
    model: ModelFingerprint
    num_stages: int = 1


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """Liveness tick; carries the sender's monotonic sequence number."""

    seq: int


class Goodbye(msgspec.Struct, frozen=True, tag="goodbye"):
    """Orderly shutdown of the sender; the receiver stops without error."""

    reason: str = "closed"


class HandshakeReject(msgspec.Struct, frozen=True, tag="reject"):
    """The FFN side's answer to a hello that does not match its own.

    Sent to every attention peer of the rendezvous, so both roles raise the
    same ``HandshakeError(field, attention, ffn)``. A control plane other than
    the built-in one sends it too, so the rejection reads the same everywhere.
    """

    field: str
    attention: str
    ffn: str


ControlMessage = ControlPayload | Hello | Heartbeat | Goodbye | HandshakeReject

_control_encoder = msgspec.msgpack.Encoder()
_control_decoder = msgspec.msgpack.Decoder(ControlMessage)


def encode_control(message: ControlMessage) -> bytes:
    """Encode one control-plane message as msgpack."""
    return _control_encoder.encode(message)


def decode_control(data: bytes | memoryview) -> ControlMessage:
    """Decode one control-plane message; any malformed input is a WireFormatError."""
    try:
        return _control_decoder.decode(data)
    except WireFormatError:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireFormatError(f"malformed control message ({len(data)} bytes): {exc}") from exc


# --- tensors ---------------------------------------------------------------

#: THE dtype table: every tensor dtype name that may go on the wire (``torch.<name>``)
WIRE_DTYPES: tuple[str, ...] = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
)
#: the subset every built-in connector moves, and what ``ConnectorCapabilities.dtypes`` declares by default
COMMON_DTYPES: frozenset[str] = frozenset(
    ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int32", "int64")
)


def dtype_to_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; the name is what goes on the wire."""
    name = str(dtype).removeprefix("torch.")
    if name not in WIRE_DTYPES:
        raise WireFormatError(f"dtype={dtype}; expected one of {', '.join(WIRE_DTYPES)}")
    return name


#: the torch dtype of each wire name looked up so far (a receive converts one per tensor frame)
_TORCH_DTYPES: dict[str, torch.dtype] = {}


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_to_name`, rejecting names not in the allow-list."""
    dtype = _TORCH_DTYPES.get(name)
    if dtype is None:
        if name not in WIRE_DTYPES:
            raise WireFormatError(f"dtype={name!r}; expected one of {', '.join(WIRE_DTYPES)}")
        import torch

        dtype = _TORCH_DTYPES[name] = getattr(torch, name)
    return dtype


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """Name, dtype and shape of one tensor frame following a header."""

    name: str
    dtype: str
    shape: tuple[int, ...]


class TensorHeader(msgspec.Struct, frozen=True, array_like=True):
    """Typed header that precedes the raw tensor frames of one message.

    ``tensors[0]`` is the hidden states (or FFN output); further entries are
    declared extras in declaration order.
    """

    kind: str  # "a2f" or "f2a"
    layer_idx: int
    stage_idx: int
    seq_lens: tuple[int, ...]
    tensors: tuple[TensorSpec, ...]


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(TensorHeader)


def encode_header(header: TensorHeader) -> bytes:
    return _header_encoder.encode(header)


def decode_header(data: bytes | memoryview) -> TensorHeader:
    """Decode a tensor header; malformed input is a WireFormatError."""
    try:
        return _header_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireFormatError(f"malformed tensor header ({len(data)} bytes): {exc}") from exc


# --- payloads handed to model code ------------------------------------------


@dataclass(frozen=True)
class A2FPayload:
    """What the FFN side receives for one layer and stage.

    ``hidden_states`` concatenates the attention peers' tokens in fan-in order;
    ``metadata.seq_lens`` says how many came from each. ``extras`` holds the
    model's declared per-token extras (e.g. ``input_ids``), token-aligned.
    """

    hidden_states: torch.Tensor
    metadata: TransferMetadata
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class F2APayload:
    """FFN output for one layer and stage: routed experts plus optional shared."""

    routed: torch.Tensor
    shared: torch.Tensor | None = None

    def combined(self) -> torch.Tensor:
        return self.routed if self.shared is None else self.routed + self.shared
