"""The connector contract: how hidden states move between the two roles.

A connector instance lives in one worker process and serves one role. Its life:

1. The plugin manager resolves the class from ``AFDConfig.connector`` at
   start-up; :meth:`AFDConnector.parse_extra_config` validates
   ``connector_extra_config`` — still no resources.
2. The runtime constructs it with a :class:`ConnectorContext`. The constructor
   only stores and checks; it opens nothing.
3. :meth:`AFDConnector.init` opens sockets / process groups and performs the
   handshake. From then on the data-path methods may be called.
4. Per layer and stage the Attention side calls ``send_attn_output`` then
   ``recv_ffn_output``; the FFN side ``recv_attn_output`` then
   ``send_ffn_output``. Calls for one stage are strictly ordered by layer.
5. :meth:`AFDConnector.close` releases everything; it is idempotent and safe
   after a partial or failed ``init``.

Data-path methods are the hot path: implementations do no plugin lookup, no
logging formatting and no pickling there.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import msgspec

from afd_sdk.config import AFDConfig, parse_extra_config
from afd_sdk.errors import AFDConfigError, ConnectorError
from afd_sdk.topology import WorldLayout
from afd_sdk.wire import A2FPayload, ControlPayload, ModelFingerprint, TransferMetadata

if TYPE_CHECKING:
    import torch

__all__ = [
    "AFDConnector",
    "AsyncDispatchConnector",
    "ConnectorCapabilities",
    "ConnectorContext",
    "ControlPlane",
    "ExtraSpec",
    "FFNWorkItem",
    "MoELayout",
    "NoExtraConfig",
]


class NoExtraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Schema of a connector that accepts no ``connector_extra_config`` keys."""


@dataclass(frozen=True)
class ExtraSpec:
    """One declared per-token extra input the FFN side needs (e.g. ``input_ids``).

    Declared by the model adapter (``ModelAdapter.ffn_extras``), carried by every
    connector that advertises ``supports_extras``: a model adds payload data
    without editing any connector. ``trailing_shape`` is the shape after the
    token dimension (``()`` for one value per token).
    """

    name: str
    dtype: str
    trailing_shape: tuple[int, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class MoELayout:
    """The routed-expert shape of a model, declared by its adapter (``ModelAdapter.moe_layout``).

    Connectors that dispatch tokens by expert (``async_dispatch``) size their
    routing from it: ``num_experts`` routed experts, ``top_k`` of them per
    token, on the decoder layers ``moe_layers`` (the others are dense and run
    on Attention when the gate does).
    """

    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]


@dataclass(frozen=True)
class ConnectorCapabilities:
    """What a connector can do; the runtime and the conformance suite read it.

    * ``devices``: tensor devices accepted (``"cpu"``, ``"cuda"``, ``"npu"``).
    * ``world_layout``: which rank ordering it uses (see :mod:`afd_sdk.topology`).
    * ``attention_lt_ffn``: whether A < F is supported.
    * ``supports_extras``: whether declared FFN extras travel with hidden states.
    * ``async_dispatch``: routed-expert dispatch/combine (CAM style) rather than
      whole hidden states per layer.
    * ``dtypes``: tensor dtypes it moves.
    * ``same_host_only``: both roles must share a host (shared memory).
    """

    devices: frozenset[str] = frozenset({"cpu"})
    world_layout: WorldLayout = "ffn_first"
    attention_lt_ffn: bool = False
    supports_extras: bool = True
    async_dispatch: bool = False
    dtypes: frozenset[str] = frozenset({"float32", "float16", "bfloat16", "int8"})
    same_host_only: bool = False


@dataclass(frozen=True)
class ConnectorContext:
    """Everything a connector is constructed with; built by the runtime.

    ``role_rank`` is this worker's rank inside its role
    (:func:`afd_sdk.topology.role_rank`). ``max_num_tokens`` bounds the tokens
    one Attention rank sends per stage, so receive buffers can be sized once.
    ``moe`` is the model's routed-expert layout (``None`` for dense models);
    ``async_dispatch`` connectors require it.
    """

    config: AFDConfig
    role_rank: int
    model: ModelFingerprint
    extra_config: msgspec.Struct = field(default_factory=NoExtraConfig)
    ffn_extras: tuple[ExtraSpec, ...] = ()
    max_num_tokens: int = 8192
    device: str = "cpu"
    moe: MoELayout | None = None

    @property
    def role(self) -> Literal["attention", "ffn"]:
        return self.config.role


class ControlPlane(abc.ABC):
    """Tells the FFN side what is coming in the next step.

    Attention ranks call :meth:`send` once per step before the first layer; the
    FFN side calls :meth:`recv` once per step and then serves
    ``num_stages × num_layers`` exchanges. Also owns liveness: a peer that dies
    makes every blocked call on the survivor raise ``PeerLostError`` within
    ``timeout_s``.
    """

    @abc.abstractmethod
    def init(self) -> None:
        """Rendezvous and handshake. Called once by the owning connector's ``init``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Send an orderly goodbye and release resources. Idempotent."""

    @abc.abstractmethod
    def send(self, payload: ControlPayload) -> None:
        """Attention side: announce one step. Called by the runner before layer 0.

        May assume ``init()`` succeeded. Must not block longer than ``timeout_s``.
        """

    @abc.abstractmethod
    def recv(self, timeout_s: float | None = None) -> ControlPayload | None:
        """FFN side: block until the next step's payload, merged over peers.

        Returns ``None`` when every attention peer said goodbye (orderly end).
        Raises ``PeerLostError`` when a peer died or nothing came within
        ``timeout_s`` (default: the config's). The merged payload's
        ``stage_token_counts[s]`` has one entry per attention peer, fan-in order.
        """

    def apply(self, payload: ControlPayload) -> None:
        """Record ``payload`` as the current step locally (both roles).

        Called by the runtime after :meth:`send` / :meth:`recv`; connectors read
        :attr:`current` to size the step's buffers.
        """
        self._current = payload

    @property
    def current(self) -> ControlPayload | None:
        """The payload last passed to :meth:`apply`, or ``None`` before the first step."""
        return getattr(self, "_current", None)


class AFDConnector(abc.ABC):
    """Base class of every AFD transport. Subclass it and register the class
    through the ``afd_register_connectors`` hook.

    Class attributes a subclass sets: ``name`` (canonical registry name) and
    ``capabilities``. Subclasses that take ``connector_extra_config`` override
    ``extra_config_schema`` with a closed ``msgspec.Struct``.
    """

    name: ClassVar[str] = ""
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities()
    extra_config_schema: ClassVar[type[msgspec.Struct]] = NoExtraConfig

    def __init__(self, context: ConnectorContext) -> None:
        """Store the context. Opens nothing; called by the runtime after validation."""
        self.context = context
        self.config = context.config
        self.role = context.config.role
        self.role_rank = context.role_rank
        #: stage -> (layer, tokens) of the send awaiting its ``recv_ffn_output`` (see :meth:`record_send`)
        self._sent: dict[int, tuple[int, int]] = {}
        self._hidden_size = context.model.hidden_size  # read by the per-message checks
        extra = context.extra_config
        #: the parsed ``connector_extra_config`` (the schema's defaults when none was parsed)
        self.extra: Any = extra if isinstance(extra, self.extra_config_schema) else self.extra_config_schema()

    # --- configuration (no resources) ---------------------------------------

    @classmethod
    def parse_extra_config(cls, raw: Mapping[str, Any]) -> msgspec.Struct:
        """Validate ``connector_extra_config`` into ``extra_config_schema``.

        Called by the plugin manager / runtime before any resource exists.
        Unknown keys and wrong types raise ``AFDConfigError``.
        """
        return parse_extra_config(cls.extra_config_schema, raw, connector=cls.name or cls.__name__)

    @classmethod
    def stage_extra_config(cls, num_stages: int) -> dict[str, Any]:
        """``connector_extra_config`` keys this connector needs to run ``num_stages`` micro-batch stages.

        Called by tools that build a config for the user (``afd demo``, the
        conformance suites) before anything is resolved; the result is merged
        into the user's extra config. Default: none.
        """
        return {}

    @classmethod
    def validate_config(cls, config: AFDConfig) -> None:
        """Reject configs this connector cannot serve (e.g. A < F). Called before ``init``.

        The default checks A:F against ``capabilities``; override to add rules
        and call ``super()``.
        """
        from afd_sdk.topology import ffn_first_world

        if cls.capabilities.world_layout == "ffn_first" and not cls.capabilities.attention_lt_ffn:
            ffn_first_world(config.num_attention_ranks, config.num_ffn_ranks)

    # --- lifecycle ----------------------------------------------------------

    @abc.abstractmethod
    def init(self) -> None:
        """Open transports and handshake with the peer role. Called once by the runtime.

        Blocks at most ``config.timeout_s``; raises ``HandshakeError`` on any
        disagreement and ``PeerLostError`` if the peer never arrives. After a
        failure the caller still calls :meth:`close`.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything. Idempotent; safe after a partial or failed ``init``.

        A closed connector may be ``init()``-ed again.
        """

    @property
    @abc.abstractmethod
    def is_initialized(self) -> bool:
        """True between a successful ``init()`` and ``close()``."""

    @property
    def control_plane(self) -> ControlPlane | None:
        """The control plane that drives FFN steps, or ``None``.

        Not ``None``: the FFN server calls ``control_plane.recv()`` once per step
        and knows every stage's token counts in advance. ``None``: the FFN side
        is connector-driven and learns the work from ``recv_attn_output`` alone.
        """
        return None

    # --- data path: Attention side ------------------------------------------

    @abc.abstractmethod
    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Attention: send one layer's post-attention-norm hidden states to FFN.

        Called by the FFN proxy once per layer and stage. May assume
        ``hidden_states`` is ``[metadata.seq_lens[0], hidden]`` and contiguous,
        ``extras`` holds exactly the declared FFN extras, token-aligned. The
        caller does not modify ``hidden_states`` until ``recv_ffn_output`` for
        the same stage returns.
        """

    @abc.abstractmethod
    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        """Attention: wait for the FFN output of the last send on ``stage_idx``.

        Returns a tensor with ``ref_tensor``'s shape, dtype and device. The
        result may live in a reused receive buffer that stays valid until the
        next ``recv_ffn_output`` for the same stage. Raises ``PeerLostError``
        after ``timeout_s``.
        """

    # --- data path: FFN side ------------------------------------------------

    @abc.abstractmethod
    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        """FFN: receive one layer's hidden states from every attention peer.

        Called by the FFN server once per layer and stage, in layer order.
        Tokens are concatenated in fan-in order; ``payload.metadata.seq_lens``
        has one entry per peer. Zero tokens is legal. The payload's tensors may
        live in a reused receive buffer (or the transport's own memory) that
        stays valid until the next ``recv_attn_output`` for the same stage.
        """

    @abc.abstractmethod
    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        """FFN: return the FFN output for the payload last received on ``metadata.stage_idx``.

        ``metadata`` is the one from that payload; the output is split by
        ``metadata.seq_lens`` back to the peers. ``output.shape[0]`` must equal
        ``metadata.num_tokens``, else ``ConnectorError``. The send may still be
        in flight on return (the connector keeps ``output`` alive); the caller
        does not modify ``output`` afterwards.
        """

    # --- helpers for implementations ----------------------------------------

    def check_attn_send(self, hidden_states: torch.Tensor, metadata: TransferMetadata) -> int:
        """Validate a ``send_attn_output`` call; return the token count. Implementations call it first.

        Raises ``ConnectorError`` unless ``hidden_states`` is ``[n, hidden_size]``
        and ``metadata.seq_lens == (n,)``.
        """
        hidden = self._hidden_size
        shape = hidden_states.shape  # one torch call: this runs per layer and stage
        n = shape[0] if len(shape) == 2 else -1
        if n < 0 or shape[1] != hidden or metadata.seq_lens != (n,):
            raise ConnectorError(
                f"hidden_states {list(hidden_states.shape)} with seq_lens={metadata.seq_lens}; "
                f"expected [seq_lens[0], {hidden}] with one seq_len on the attention side"
            )
        return n

    def check_no_send_pending(self, stage_idx: int) -> None:
        """Attention side: raise unless ``stage_idx`` has no send awaiting its FFN output."""
        if stage_idx in self._sent:
            raise ConnectorError(f"stage {stage_idx} already has a send awaiting recv_ffn_output()")

    def record_send(self, metadata: TransferMetadata, num_tokens: int) -> None:
        """Attention side: remember a completed ``send_attn_output`` until its ``recv_ffn_output``."""
        self._sent[metadata.stage_idx] = (metadata.layer_idx, num_tokens)

    def take_send(self, stage_idx: int) -> tuple[int, int]:
        """Attention side: ``(layer, tokens)`` of the send ``recv_ffn_output`` answers; raises without one."""
        sent = self._sent.pop(stage_idx, None)
        if sent is None:
            raise ConnectorError(f"recv_ffn_output(stage_idx={stage_idx}) without a preceding send_attn_output")
        return sent

    def check_ffn_send(self, output: torch.Tensor, metadata: TransferMetadata, num_peers: int) -> None:
        """Validate a ``send_ffn_output`` call against this FFN rank's ``num_peers`` attention peers."""
        hidden = self._hidden_size
        if len(metadata.seq_lens) != num_peers:
            raise ConnectorError(
                f"metadata.seq_lens={metadata.seq_lens} has {len(metadata.seq_lens)} entries; "
                f"this ffn rank has {num_peers} attention peers"
            )
        shape = output.shape
        if len(shape) != 2 or shape[0] != metadata.num_tokens or shape[1] != hidden:
            raise ConnectorError(
                f"ffn output shape {list(output.shape)}; expected [{metadata.num_tokens}, {hidden}] "
                f"(sum of seq_lens={metadata.seq_lens})"
            )

    def _require_initialized(self) -> None:
        if not self.is_initialized:
            raise ConnectorError(f"{self.name or type(self).__name__} is not initialised; call init() first")

    def _require_role(self, role: str, method: str) -> None:
        if self.role != role:
            raise ConnectorError(f"{method}() is a {role}-side call; this connector serves role={self.role!r}")


@dataclass
class FFNWorkItem:
    """One layer's routed tokens for one FFN rank, as received by an async-dispatch connector.

    ``hidden_states`` is ``[num_tokens, hidden]``: one row per (token, routed
    expert) pair whose expert lives on this rank, grouped by local expert —
    ``group_list[e]`` rows for local expert ``e`` (global id
    ``expert_start + e``), in order. ``peer_tokens[a]`` counts the rows that
    came from attention rank ``a`` (0 for a rank that sent none or has left).
    ``num_tokens`` may be 0: the exchange still completes, with an empty output.
    ``state`` is the connector's private transfer state; the caller passes the
    item back unchanged to ``send_ffn_work_item_output``.
    """

    layer_idx: int
    stage_idx: int
    hidden_states: torch.Tensor
    group_list: torch.Tensor
    expert_start: int
    peer_tokens: tuple[int, ...]
    state: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.hidden_states.shape[0])


class AsyncDispatchConnector(AFDConnector):
    """Base of connectors that dispatch routed experts (CAM style) instead of whole hidden states.

    The Attention side runs the router gate (``compute_gate_on_attention``) and,
    per MoE layer and stage, calls :meth:`send_attn_output` with the token
    routing, then :meth:`recv_ffn_output`, which returns the routed-expert
    output already combined with the top-k weights. Routing and token counts
    travel in-band, so there is no control plane: the FFN side is driven by
    :meth:`recv_ffn_work_item` / :meth:`send_ffn_work_item_output`.

    ``recv_attn_output`` / ``send_ffn_output`` map onto the work-item calls
    (the payload's rows are the item's rows), so generic FFN loops still work.
    """

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        if context.moe is None:
            raise AFDConfigError(
                f"ConnectorContext.moe=None, but {self.name or type(self).__name__} dispatches by expert and needs "
                "the model's MoELayout; expected the adapter's moe_layout() (a dense model cannot use it)",
                key="moe",
                value=None,
            )
        self.moe: MoELayout = context.moe
        self._generic_items: dict[int, FFNWorkItem] = {}  # stage -> item awaiting send_ffn_output

    @abc.abstractmethod
    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
    ) -> None:
        """Attention: dispatch one MoE layer's tokens to the FFN ranks owning their experts.

        Called by the experts proxy once per MoE layer and stage, in layer
        order. ``topk_ids`` (int64, ``[n, top_k]``, global expert ids) and
        ``topk_weights`` (``[n, top_k]``) are required; the dispatch is queued
        FIFO per stage for :meth:`recv_ffn_output`. ``n`` may be 0.
        """

    @abc.abstractmethod
    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        """Attention: combine the oldest pending dispatch of ``stage_idx``.

        Returns ``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x_t)`` as
        a tensor with ``ref_tensor``'s shape, dtype and device. Raises
        ``PeerLostError`` after ``timeout_s``.
        """

    @abc.abstractmethod
    def recv_ffn_work_item(self, stage_idx: int = 0) -> FFNWorkItem | None:
        """FFN: receive the next MoE layer's routed tokens of ``stage_idx`` from every attention rank.

        Called by the FFN server in a fixed round-robin over stages. Returns
        ``None`` once every attention rank has said goodbye (orderly end);
        raises ``PeerLostError`` when a peer died or nothing came within
        ``timeout_s``.
        """

    @abc.abstractmethod
    def send_ffn_work_item_output(self, item: FFNWorkItem, output: torch.Tensor) -> None:
        """FFN: return the unweighted expert outputs of ``item``, row for row.

        ``output`` is ``[item.num_tokens, hidden]`` (``[0, hidden]`` for an
        empty item); the Attention side applies the top-k weights. The send
        may still be in flight on return; the caller does not modify
        ``output`` afterwards.
        """

    # generic FFN loops: the payload is the item; send_ffn_output answers the item last received per stage

    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        item = self.recv_ffn_work_item(stage_idx)
        if item is None:
            raise ConnectorError("every attention rank said goodbye; no more work items")
        self._generic_items[stage_idx] = item
        return A2FPayload(item.hidden_states, TransferMetadata(item.layer_idx, stage_idx, item.peer_tokens), {})

    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        item = self._generic_items.pop(metadata.stage_idx, None)
        if item is None:
            raise ConnectorError(f"send_ffn_output(stage_idx={metadata.stage_idx}) without a received work item")
        self.send_ffn_work_item_output(item, output)
