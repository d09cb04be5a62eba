"""Rank arithmetic for AFD worlds. Pure functions; no process group is touched.

Two orderings exist because two connector families exist:

* **FFN-first** (P2P, ZMQ, shm): global ranks ``0..F-1`` are FFN, ``F..F+A-1``
  Attention. Each FFN rank serves a contiguous block of Attention ranks; blocks
  are as even as possible (5A2F → 3+2), so A need not be a multiple of F —
  upstream requires ``A % F == 0``, we do not. A < F is rejected: an Attention
  rank sends each layer to exactly one FFN rank.
* **Attention-first** (CAM): ranks ``0..A-1`` Attention, ``A..A+F-1`` FFN; every
  Attention rank talks to every FFN rank, and routed experts are placed across
  the FFN ranks in contiguous blocks. Any A:F works.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Literal

from afd_sdk.errors import TopologyError

__all__ = [
    "AttentionFirstWorld",
    "FFNFirstWorld",
    "World",
    "WorldLayout",
    "attention_first_world",
    "build_world",
    "even_blocks",
    "ffn_first_world",
    "role_rank",
]

WorldLayout = Literal["ffn_first", "attention_first"]


def _check(name: str, value: int, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise TopologyError(f"{name}={value!r} is out of range; expected an integer {bound}", key=name, value=value)


def role_rank(*, dp_rank: int, pcp_rank: int, tp_rank: int, dp_size: int, pcp_size: int, tp_size: int) -> int:
    """Rank of a worker inside its role: ``(dp*pcp_size + pcp_rank)*tp_size + tp_rank``."""
    _check("dp_size", dp_size, 1)
    _check("pcp_size", pcp_size, 1)
    _check("tp_size", tp_size, 1)
    _check("dp_rank", dp_rank, 0, dp_size - 1)
    _check("pcp_rank", pcp_rank, 0, pcp_size - 1)
    _check("tp_rank", tp_rank, 0, tp_size - 1)
    return (dp_rank * pcp_size + pcp_rank) * tp_size + tp_rank


def even_blocks(total: int, parts: int) -> tuple[tuple[int, int], ...]:
    """Split ``range(total)`` into ``parts`` contiguous ``(start, stop)`` blocks.

    The first ``total % parts`` blocks get one extra element: 5 into 2 → (0,3),(3,5).
    """
    _check("parts", parts, 1)
    _check("total", total, 0)
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return tuple(out)


@dataclass(frozen=True)
class FFNFirstWorld:
    """FFN-first world of ``A`` Attention and ``F`` FFN ranks (A ≥ F)."""

    num_attention: int
    num_ffn: int
    blocks: tuple[tuple[int, int], ...]  # per FFN rank: attention ranks [start, stop)

    layout: WorldLayout = "ffn_first"

    @property
    def world_size(self) -> int:
        return self.num_attention + self.num_ffn

    def global_rank(self, role: str, rank: int) -> int:
        if role == "ffn":
            _check("ffn rank", rank, 0, self.num_ffn - 1)
            return rank
        _check("attention rank", rank, 0, self.num_attention - 1)
        return self.num_ffn + rank

    def ffn_for_attention(self, attention_rank: int) -> int:
        """The one FFN rank an Attention rank exchanges with."""
        _check("attention rank", attention_rank, 0, self.num_attention - 1)
        for ffn, (start, stop) in enumerate(self.blocks):
            if start <= attention_rank < stop:
                return ffn
        raise AssertionError("unreachable: blocks cover every attention rank")

    def attention_for_ffn(self, ffn_rank: int) -> tuple[int, ...]:
        """Attention ranks served by ``ffn_rank``, in fan-in order."""
        _check("ffn rank", ffn_rank, 0, self.num_ffn - 1)
        start, stop = self.blocks[ffn_rank]
        return tuple(range(start, stop))

    def as_dict(self) -> dict[str, object]:
        return {
            "layout": self.layout,
            "world_size": self.world_size,
            "ranks": [
                {
                    "global_rank": self.global_rank("ffn", f),
                    "role": "ffn",
                    "role_rank": f,
                    "peers": list(self.attention_for_ffn(f)),
                }
                for f in range(self.num_ffn)
            ]
            + [
                {
                    "global_rank": self.global_rank("attention", a),
                    "role": "attention",
                    "role_rank": a,
                    "peers": [self.ffn_for_attention(a)],
                }
                for a in range(self.num_attention)
            ],
        }


def ffn_first_world(num_attention: int, num_ffn: int) -> FFNFirstWorld:
    """Build the FFN-first world; A < F is a :class:`TopologyError`."""
    _check("num_attention_ranks", num_attention, 1)
    _check("num_ffn_ranks", num_ffn, 1)
    if num_attention < num_ffn:
        raise TopologyError(
            f"num_attention_ranks={num_attention} < num_ffn_ranks={num_ffn}: a point-to-point world needs "
            "A >= F (each Attention rank sends to one FFN rank); use an attention-first connector such as "
            "CAMAsyncAFDConnector for A < F",
            key="num_attention_ranks",
            value=num_attention,
        )
    return FFNFirstWorld(num_attention, num_ffn, even_blocks(num_attention, num_ffn))


@dataclass(frozen=True)
class AttentionFirstWorld:
    """Attention-first world with routed experts placed on FFN ranks.

    Expert policy when ``E % F != 0``: contiguous blocks, the first ``E % F``
    FFN ranks hold one expert more (E=10, F=3 → 4,3,3). ``E < F`` is rejected:
    an FFN rank with no expert would do no work.

    Redundant experts (``expert_replicas`` R > 1, R divides F): the FFN ranks
    form groups of R consecutive ranks, and every rank of a group holds the
    whole group's block (the union of its members' ``expert_blocks``), so each
    expert lives on R ranks. Rank ``f`` is the *primary* of its own block;
    :meth:`routing` sends an expert to its primary while that rank is live, else
    to the next live member of its group (ring order), the same on every rank
    that knows the same lost set: a remap that needs no message.
    """

    num_attention: int
    num_ffn: int
    num_experts: int
    expert_blocks: tuple[tuple[int, int], ...]  # the primary block of each FFN rank

    layout: WorldLayout = "attention_first"
    expert_replicas: int = 1

    @property
    def world_size(self) -> int:
        return self.num_attention + self.num_ffn

    def global_rank(self, role: str, rank: int) -> int:
        if role == "attention":
            _check("attention rank", rank, 0, self.num_attention - 1)
            return rank
        _check("ffn rank", rank, 0, self.num_ffn - 1)
        return self.num_attention + rank

    def expert_owner(self, expert: int) -> int:
        _check("expert", expert, 0, self.num_experts - 1)
        for ffn, (start, stop) in enumerate(self.expert_blocks):
            if start <= expert < stop:
                return ffn
        raise AssertionError("unreachable")

    def local_experts(self, ffn_rank: int) -> range:
        """The experts ``ffn_rank`` holds (loads and serves): its group's block, its own with R = 1."""
        _check("ffn rank", ffn_rank, 0, self.num_ffn - 1)
        first = ffn_rank - ffn_rank % self.expert_replicas
        return range(self.expert_blocks[first][0], self.expert_blocks[first + self.expert_replicas - 1][1])

    def primary_experts(self, ffn_rank: int) -> range:
        """The experts routed to ``ffn_rank`` while every rank is live."""
        _check("ffn rank", ffn_rank, 0, self.num_ffn - 1)
        return range(*self.expert_blocks[ffn_rank])

    def expert_holders(self, expert: int) -> tuple[int, ...]:
        """The FFN ranks holding ``expert``: its primary first, then the rest of its group in ring order."""
        primary = self.expert_owner(expert)
        r = self.expert_replicas
        first = primary - primary % r
        return tuple(first + (primary - first + i) % r for i in range(r))

    def routing(self, lost: AbstractSet[int] = frozenset()) -> tuple[int | None, ...]:
        """Expert id → the FFN rank it is sent to when the FFN ranks in ``lost`` are gone (``None``: no holder left).

        Pure and deterministic: every attention rank that knows the same lost set computes the same map.
        """
        return tuple(next((f for f in self.expert_holders(e) if f not in lost), None) for e in range(self.num_experts))

    def as_dict(self) -> dict[str, object]:
        return {
            "layout": self.layout,
            "world_size": self.world_size,
            "num_experts": self.num_experts,
            "expert_replicas": self.expert_replicas,
            "ranks": [
                {"global_rank": a, "role": "attention", "role_rank": a, "peers": list(range(self.num_ffn))}
                for a in range(self.num_attention)
            ]
            + [
                {
                    "global_rank": self.num_attention + f,
                    "role": "ffn",
                    "role_rank": f,
                    "peers": list(range(self.num_attention)),
                    "experts": list(self.local_experts(f)),
                    "primary_experts": list(self.primary_experts(f)),
                }
                for f in range(self.num_ffn)
            ],
        }


def attention_first_world(
    num_attention: int, num_ffn: int, num_experts: int, expert_replicas: int = 1
) -> AttentionFirstWorld:
    """Build the Attention-first (CAM) world with experts spread over FFN ranks, each on ``expert_replicas``."""
    _check("num_attention_ranks", num_attention, 1)
    _check("num_ffn_ranks", num_ffn, 1)
    _check("num_experts", num_experts, 1)
    _check("expert_replicas", expert_replicas, 1)
    if num_ffn % expert_replicas:
        raise TopologyError(
            f"expert_replicas={expert_replicas} does not divide num_ffn_ranks={num_ffn}: the FFN ranks form "
            "groups of expert_replicas ranks that hold the same experts; expected a divisor of num_ffn_ranks",
            key="expert_replicas",
            value=expert_replicas,
        )
    if num_experts < num_ffn:
        raise TopologyError(
            f"num_experts={num_experts} < num_ffn_ranks={num_ffn}: every FFN rank must hold at least one "
            "routed expert; use at most num_experts FFN ranks",
            key="num_experts",
            value=num_experts,
        )
    blocks = even_blocks(num_experts, num_ffn)
    return AttentionFirstWorld(num_attention, num_ffn, num_experts, blocks, expert_replicas=expert_replicas)


World = FFNFirstWorld | AttentionFirstWorld


def build_world(
    layout: WorldLayout,
    num_attention: int,
    num_ffn: int,
    *,
    num_experts: int | None = None,
    expert_replicas: int = 1,
) -> World:
    """THE rank layout of an AFD world: every caller (connectors, runtime, CLI) gets its world here.

    ``layout`` is the connector's ``capabilities.world_layout``; an
    attention-first world also places ``num_experts`` routed experts (the
    model's ``MoELayout.num_experts``), each on ``expert_replicas`` FFN
    ranks. Pure: no process group is touched. Raises :class:`TopologyError`
    naming the count that cannot work.
    """
    if layout == "ffn_first":
        return ffn_first_world(num_attention, num_ffn)
    if layout == "attention_first":
        if num_experts is None:
            raise TopologyError(
                "num_experts=None for an attention_first world; expected the model's routed-expert count "
                "(its adapter's moe_layout())",
                key="num_experts",
                value=None,
            )
        return attention_first_world(num_attention, num_ffn, num_experts, expert_replicas)
    raise TopologyError(
        f"world_layout={layout!r} is unknown; expected 'ffn_first' or 'attention_first'",
        key="world_layout",
        value=layout,
    )
