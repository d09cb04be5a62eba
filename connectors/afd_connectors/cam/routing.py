"""Attention side of CAM: which FFN rank each routed expert is sent to now, and the FFN ranks lost so far.

With ``expert_replicas`` R = 1 every expert has one holder and nothing here changes after start-up. With
R > 1 an FFN rank that is lost (its connection closed mid-exchange, or its heartbeats stopped) joins
:attr:`ExpertRouting.lost`, and the table is recomputed with :meth:`AttentionFirstWorld.routing
<afd_sdk.topology.AttentionFirstWorld.routing>`: a pure function of the lost set, so every attention rank that
saw the same losses routes the same way without a message (vLLM's FT-EPLB remaps its redundant experts the
same way). A rank that rejoins (:mod:`afd_connectors.cam.rejoin`) leaves the set again at the step every
attention rank agreed on. The table is read per dispatch; it changes only on a loss or a rejoin.
"""

from __future__ import annotations

from typing import Any

import torch

from afd_sdk.errors import PeerLostError
from afd_sdk.topology import AttentionFirstWorld

__all__ = ["ExpertRouting"]


class ExpertRouting:
    """The routing table of one attention rank; owned and updated by its backend's thread only."""

    def __init__(self, world: AttentionFirstWorld, device: Any, owner: str) -> None:
        self.world = world
        self.device = device
        self.owner = owner
        #: FFN ranks this attention rank no longer sends to
        self.lost: set[int] = set()
        #: the same, replaced (never mutated) on each loss: for readers on other threads
        self.lost_snapshot: frozenset[int] = frozenset()
        #: how many times the lost set changed (the membership epoch of this rank's routing)
        self.epoch = 0
        self.held = tuple(world.local_experts(f) for f in range(world.num_ffn))
        self._compute()

    def _compute(self) -> None:
        w = self.world
        self.route = w.routing(self.lost)
        #: live FFN ranks in ascending order: the order of the sorted rows and of the sends
        self.targets = tuple(f for f in range(w.num_ffn) if f not in self.lost)
        #: per FFN rank, the experts routed to it, as offsets into its held range (its header's counts)
        self.assigned = tuple(
            tuple(e - self.held[f].start for e in self.held[f] if self.route[e] == f) for f in range(w.num_ffn)
        )
        # rows are sorted by (target rank, expert): plain expert order while each expert goes to its primary
        # (primary blocks ascend with the rank), a key that groups by target once one was re-routed
        remapped = any(r != w.expert_owner(e) for e, r in enumerate(self.route))
        self.sort_key: torch.Tensor | None = (
            torch.tensor(
                [(w.num_ffn if r is None else r) * w.num_experts + e for e, r in enumerate(self.route)],
                dtype=torch.int64,
                device=self.device,
            )
            if remapped
            else None
        )

    def counts(self, ffn: int, per_expert: list[int]) -> list[int]:
        """The header counts for ``ffn``: rows per expert it holds, 0 for experts routed elsewhere."""
        held = self.held[ffn]
        if self.world.expert_replicas == 1:
            return per_expert[held.start : held.stop]
        out = [0] * len(held)
        for i in self.assigned[ffn]:
            out[i] = per_expert[held.start + i]
        return out

    def lose(self, ffn: int, why: str) -> None:
        """Stop routing to ``ffn``; ``PeerLostError`` when an expert it held has no live holder left."""
        if ffn in self.lost:
            return
        self.lost.add(ffn)
        self.lost_snapshot = frozenset(self.lost)
        self.epoch += 1
        self._compute()
        orphans = [e for e, r in enumerate(self.route) if r is None]
        if orphans:
            holders = self.world.expert_holders(orphans[0])
            raise PeerLostError(
                f"{self.owner}: ffn rank {ffn} lost ({why}) and experts {orphans[0]}..{orphans[-1]} have no live "
                f"holder left (held by ffn ranks {list(holders)}; connector_extra_config.expert_replicas="
                f"{self.world.expert_replicas})"
            )

    def restore(self, ffn: int) -> None:
        """Route to ``ffn`` again (it rejoined); its experts go back to it as while it was never lost."""
        if ffn not in self.lost:
            return
        self.lost.discard(ffn)
        self.lost_snapshot = frozenset(self.lost)
        self.epoch += 1
        self._compute()
