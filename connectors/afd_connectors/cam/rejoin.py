"""A restarted FFN rank rejoins a running CAM world (redundant experts, portable backend).

A Gloo group's members are fixed once it forms, so a new incarnation of FFN rank ``f`` cannot take the old
one's place in the world's stage groups. It gets groups of its own instead: with each attention rank ``a``, one
2-rank group per stage (``a`` is its rank 0, the FFN rank its rank 1), formed on the world's store under
``<ns>/rejoin/<f>.<i>/a<a>``. Every attention rank must start routing to it at the same step (an FFN rank
serves an exchange once every live attention rank's header is in), and they agree on that step through the
store, with nothing on the data path:

1. the new process finds ``<ns>/formed`` set (attention rank 0 sets it once the world formed), takes the next
   incarnation ``i`` of its rank (``<ns>/incarnation/<f>``), announces it in ``<ns>/joining/<world rank>`` and
   adds 1 to ``<ns>/joins``, which attention ranks read in each heartbeat
   (:mod:`afd_connectors.cam.liveness`);
2. an attention rank that routes around ``f`` (lost or drained) and sees the announcement sets
   ``<ns>/accept/<f>.<i>/<a>`` at its next step boundary and forms its groups with the new process on a thread;
   the new process waits (``connect_timeout_s``) for every attention rank's accept, then forms its groups with
   each; an attention rank whose groups formed sets ``<ns>/ready/<f>.<i>/<a>``;
3. the first attention rank to find every ready key at a step boundary, at its step ``k``, proposes step
   ``k + 2`` (``compare_set`` of ``<ns>/admit/<f>.<i>``). No attention rank completes a step's first exchange
   before every rank sent it (and an FFN rank posts one header receive ahead), so no other rank is past its
   boundary ``k + 1``; each has a join pending and reads the key at every boundary, so each reaches the proposed
   step knowing it;
4. at that step every attention rank routes to ``f`` again (:meth:`ExpertRouting.restore
   <afd_connectors.cam.routing.ExpertRouting.restore>`, the same table everywhere) and watches the new
   incarnation's heartbeat (:meth:`StoreHeartbeat.readmit
   <afd_connectors.cam.liveness.StoreHeartbeat.readmit>`).

A join is carried out at step boundaries: while the world idles it waits for the next step. A new process for a
rank the attention ranks still route to (its old process is alive) waits for their accept as a standby and
rejoins once that rank is lost, or gives up after ``connect_timeout_s``. A join not agreed within
``connect_timeout_s + 2 × timeout_s`` of its accept, or superseded by a newer incarnation, is *cancelled*:
``compare_set`` writes ``cancelled`` into its admit key unless a step is there already (then that step holds for
every rank), so no rank can admit it afterwards. Every attention rank of the world takes part: one that left
(said goodbye) never accepts, and the join is cancelled at its deadline.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from afd_sdk.control import shutdown_groups, stage_groups
from afd_sdk.errors import ConnectorError, PeerLostError

if TYPE_CHECKING:
    from afd_connectors.cam.backend import CamHost
    from afd_connectors.cam.liveness import StoreHeartbeat

__all__ = ["JoinAdmission", "is_running", "join_running_world", "mark_formed"]

logger = logging.getLogger(__name__)


def _formed(ns: str) -> str:
    return f"{ns}/formed"


def _tag(ffn: int, incarnation: int) -> str:
    return f"{ffn}.{incarnation}"


def mark_formed(store: Any, ns: str) -> None:
    """Attention rank 0, once the world's groups formed: a later FFN process of this world is a rejoin."""
    store.set(_formed(ns), "1")


def is_running(store: Any, ns: str) -> bool:
    """Whether the world on ``store`` formed already (a new FFN process must rejoin it)."""
    return bool(store.check([_formed(ns)]))


def _groups(conn: CamHost, store: Any, ns: str, ffn: int, incarnation: int, attention: int) -> list[Any]:
    """The 2-rank stage groups between ``attention`` and incarnation ``incarnation`` of FFN rank ``ffn``."""
    cfg = conn.config
    return stage_groups(
        store,
        f"{ns}/rejoin/{_tag(ffn, incarnation)}/a{attention}",
        1 if conn.role == "ffn" else 0,
        2,
        "nccl" if conn.device.type == "cuda" else "gloo",
        cfg.timeout_s,
        cfg.num_stages,
        host=cfg.host,
        port=cfg.port,
        interface=cfg.interface,
    )


def join_running_world(conn: CamHost, store: Any, ns: str) -> tuple[int, dict[int, list[Any]]]:
    """FFN side, a new process of a running world: announce it, wait for every attention rank's accept and form
    the groups with each. Returns the incarnation and ``{attention rank: its stage groups}``.

    ``PeerLostError`` when the attention ranks do not accept within ``connect_timeout_s`` or a group cannot form.
    """
    import torch.distributed as dist

    cfg, world, ffn = conn.config, conn.world, conn.role_rank
    incarnation = int(store.add(f"{ns}/incarnation/{ffn}", 1))
    tag = _tag(ffn, incarnation)
    store.set(f"{ns}/joining/{conn.world_rank}", str(incarnation))
    store.add(f"{ns}/joins", 1)
    logger.warning(
        "%s: ffn rank %d joins a running world as incarnation %d; waiting up to afd.connect_timeout_s=%gs for the "
        "attention ranks to accept it (they do at their next step once they route around ffn rank %d)",
        conn.name,
        ffn,
        incarnation,
        cfg.connect_timeout_s,
        ffn,
    )
    accepts = [f"{ns}/accept/{tag}/{a}" for a in range(world.num_attention)]
    try:
        store.wait(accepts, datetime.timedelta(seconds=cfg.connect_timeout_s))
    except (RuntimeError, dist.DistStoreError) as exc:
        missing = [a for a, key in enumerate(accepts) if not store.check([key])]
        raise PeerLostError(
            f"{conn.name}: attention ranks {missing} did not accept ffn rank {ffn}'s rejoin (incarnation "
            f"{incarnation}) within afd.connect_timeout_s={cfg.connect_timeout_s:g}s; they accept a rank they route "
            "around (lost or drained) at their next step"
        ) from exc
    links: dict[int, list[Any]] = {}
    try:
        for a in range(world.num_attention):
            links[a] = _groups(conn, store, ns, ffn, incarnation, a)
    except BaseException:
        for groups in links.values():
            shutdown_groups(groups, conn.name)
        raise
    return incarnation, links


@dataclass
class _Join:
    """One attention rank's side of one rejoin."""

    ffn: int
    incarnation: int
    deadline: float  # monotonic time by which the step must be agreed, else the join is cancelled
    lock: threading.Lock = field(default_factory=threading.Lock)  # orders the forming thread and close()
    groups: list[Any] | None = None
    error: str | None = None
    admit_step: int | None = None

    def fail(self, why: str) -> list[Any] | None:
        """Mark it failed; the groups it formed, for the caller to shut down (a forming thread shuts its own)."""
        with self.lock:
            self.error = self.error or why
            groups, self.groups = self.groups, None
        return groups


_CANCELLED = "cancelled"


class JoinAdmission:
    """Attention side: the rejoins under way, advanced at each step boundary by the backend's thread."""

    def __init__(self, conn: CamHost, store: Any, ns: str, liveness: StoreHeartbeat) -> None:
        self._conn = conn
        self._store = store
        self._ns = ns
        self._liveness = liveness
        self._joins: dict[int, _Join] = {}  # ffn rank -> its join under way
        self._admitted: dict[int, int] = {}  # ffn rank -> the last incarnation admitted (older ones never again)

    def pending(self) -> bool:
        """Whether a boundary has work: a join under way, or one announced (cheap: attribute reads)."""
        return bool(self._joins) or bool(self._liveness.joining)

    def at_boundary(self, step: int, routed_around: set[int]) -> list[tuple[int, int, list[Any]]]:
        """At the start of step ``step``: advance every join; ``(ffn rank, incarnation, stage groups)`` of each
        rank to route to again from this step on. ``routed_around``: the FFN ranks this rank routes around."""
        num_attention = self._conn.world.num_attention
        for rank, incarnation in self._liveness.joining:
            ffn = rank - num_attention
            current = self._joins.get(ffn)
            if ffn not in routed_around or incarnation <= self._admitted.get(ffn, 0):
                continue
            if current is not None and current.incarnation >= incarnation:
                continue
            if current is not None and current.error is None and not self._cancel(current, "superseded"):
                continue  # a step is agreed for the current one: it is admitted, and the newer waits its turn
            self._accept(ffn, incarnation)
        admitted = []
        for ffn, join in list(self._joins.items()):
            if join.error is not None:
                continue  # failed (logged); a newer incarnation may try again
            if join.admit_step is None and time.monotonic() > join.deadline and self._cancel(join, "timed out"):
                continue
            # ``groups`` is set before this rank's ready key, so no step can be agreed before this rank sees them
            if join.groups is None:
                continue
            if join.admit_step is None:
                join.admit_step = self._admit_step(join, step)
                if join.admit_step is not None:
                    logger.info(
                        "%s: ffn rank %d (incarnation %d) is routed to again from step %d",
                        self._conn.name,
                        ffn,
                        join.incarnation,
                        join.admit_step,
                    )
            if join.admit_step is None or join.admit_step > step:
                continue
            if join.admit_step < step:  # every rank reads the key at every boundary once ready: a bug if not
                raise ConnectorError(
                    f"{self._conn.name}: ffn rank {ffn}'s rejoin was agreed for step {join.admit_step} and this "
                    f"attention rank read it at step {step}; the attention ranks' routing would disagree"
                )
            del self._joins[ffn]
            self._admitted[ffn] = join.incarnation
            admitted.append((ffn, join.incarnation, join.groups))
        return admitted

    def formed(self) -> list[tuple[int, list[Any]]]:
        """``(ffn rank, stage groups)`` of the joins not admitted whose groups formed (for a goodbye at close)."""
        return [(f, j.groups) for f, j in self._joins.items() if j.groups is not None and j.error is None]

    def close(self) -> None:
        """Shut down the groups of joins not admitted (a thread still forming one shuts its own)."""
        joins, self._joins = self._joins, {}
        for join in joins.values():
            groups = join.fail("closed")
            if groups is not None:
                shutdown_groups(groups, self._conn.name)

    def _cancel(self, join: _Join, why: str) -> bool:
        """Cancel ``join`` unless a step was agreed for it (then record that step and return False)."""
        tag = _tag(join.ffn, join.incarnation)
        agreed = self._store.compare_set(f"{self._ns}/admit/{tag}", "", _CANCELLED).decode()
        if agreed != _CANCELLED:
            join.admit_step = int(agreed)
            return False
        groups = join.fail(why)
        if groups is not None:
            shutdown_groups(groups, self._conn.name)
        logger.warning(
            "%s: ffn rank %d's rejoin (incarnation %d) is cancelled: %s",
            self._conn.name,
            join.ffn,
            join.incarnation,
            why,
        )
        return True

    def _accept(self, ffn: int, incarnation: int) -> None:
        conn = self._conn
        cfg = conn.config
        deadline = time.monotonic() + cfg.connect_timeout_s + 2 * cfg.timeout_s
        join = self._joins[ffn] = _Join(ffn, incarnation, deadline)
        tag = _tag(ffn, incarnation)
        me = conn.role_rank
        self._store.set(f"{self._ns}/accept/{tag}/{me}", "1")
        logger.warning(
            "%s: ffn rank %d asks to rejoin (incarnation %d); forming its groups", conn.name, ffn, incarnation
        )

        def form() -> None:
            import torch.distributed as dist

            cfg = conn.config
            try:
                # a connection of its own: a store wait of the group's rendezvous would hold the backend's
                store = dist.TCPStore(
                    cfg.host,
                    cfg.port,
                    is_master=False,
                    timeout=datetime.timedelta(seconds=cfg.timeout_s),
                    wait_for_workers=False,
                )
                groups = _groups(conn, store, self._ns, ffn, incarnation, me)
                with join.lock:
                    closed = join.error is not None
                    if not closed:
                        join.groups = groups
                if closed:  # cancelled or closed while forming
                    shutdown_groups(groups, conn.name)
                    return
                store.set(f"{self._ns}/ready/{tag}/{me}", "1")
            except Exception as exc:  # any failure must end the join, or it would look forming forever
                groups = join.fail(str(exc))
                if groups is not None:
                    shutdown_groups(groups, conn.name)
                logger.warning("%s: ffn rank %d's rejoin failed: %s", conn.name, ffn, exc)

        threading.Thread(target=form, name=f"afd-cam-rejoin-{tag}", daemon=True).start()

    def _admit_step(self, join: _Join, step: int) -> int | None:
        """The step every attention rank routes to ``join``'s rank again from, or ``None`` while not agreed."""
        tag = _tag(join.ffn, join.incarnation)
        key = f"{self._ns}/admit/{tag}"
        store = self._store
        if store.check([key]):
            agreed = store.get(key).decode()
        else:
            ready = [f"{self._ns}/ready/{tag}/{a}" for a in range(self._conn.world.num_attention)]
            if not store.check(ready):
                return None
            agreed = store.compare_set(key, "", str(step + 2)).decode()
        if agreed == _CANCELLED:  # another attention rank gave it up first
            groups = join.fail("cancelled by another attention rank")
            if groups is not None:
                shutdown_groups(groups, self._conn.name)
            return None
        return int(agreed)
