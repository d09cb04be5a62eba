"""Who is alive in a CAM world while it idles: heartbeats through the world's ``TCPStore``.

CAM has no control plane (routing travels in-band on the process groups), and a Gloo receive cannot be
waited on with a timeout without breaking it: gloo turns the timeout into an error of the whole context
("Application timeout caused pair closure"), so an idle FFN rank cannot simply wait in slices. Liveness
therefore has a channel of its own. Every rank adds 1 to its counter ``<namespace>/hb/<world rank>`` in the
world's store every ``period_s`` (``timeout_s / 6``, at most 2 s), from a daemon thread on a store connection
of its own, and reads the counters of the peers it depends on in the same beat. A peer whose counter has not
moved for ``3 × period_s`` (at most ``timeout_s / 2``) is lost: it died, froze, or is cut off from the store.
The store lives in attention rank 0's process, so losing the store loses attention rank 0 for everyone.

Cost: ``1 + peers`` store round trips per period on that thread; nothing on the data path.

Draining (redundant experts): a draining FFN rank sets ``<namespace>/draining/<world rank>`` and adds 1 to
``<namespace>/drains``; attention ranks read that counter in each beat (one more round trip) and the keys when
it moved, and route around the rank at their next dispatch.

Fencing (redundant experts): an attention rank that routes around a lost FFN rank sets that rank's key
``<namespace>/fenced/<world rank>``; an FFN rank of such a world reads its own key in each beat (one more
round trip), and once set its :meth:`StoreHeartbeat.check` raises, so a rank that was frozen and resumes, or
was cut off and comes back, stops instead of waiting for work that now goes elsewhere.

Rejoining (redundant experts, :mod:`afd_connectors.cam.rejoin`): a restarted FFN rank is a new *incarnation*
``i`` of its world rank, and its keys carry it (``hb/<rank>.<i>``, ``fenced/<rank>.<i>``, ``draining/<rank>.<i>``;
the first incarnation's have no suffix), so the fence set for a lost incarnation does not stop the next one and
a frozen old process that resumes beats on a key nobody reads. It announces itself in
``<namespace>/joining/<world rank>`` and adds 1 to ``<namespace>/joins``; attention ranks read that counter in
each beat (one more round trip) and the keys when it moved.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Mapping

from afd_sdk.errors import PeerLostError

__all__ = ["StoreHeartbeat", "heartbeat_period", "rank_key"]

logger = logging.getLogger(__name__)

#: beats a peer may miss before it counts as lost
MISSED_BEATS = 3


def rank_key(namespace: str, kind: str, rank: int, incarnation: int = 0) -> str:
    """The store key of ``kind`` (``hb``, ``fenced``, ``draining``) for incarnation ``incarnation`` of world rank
    ``rank``: the first incarnation's has no suffix (the keys of a world that never rejoined are unchanged)."""
    return f"{namespace}/{kind}/{rank}" if incarnation == 0 else f"{namespace}/{kind}/{rank}.{incarnation}"


def heartbeat_period(timeout_s: float) -> float:
    """Seconds between two beats for ``afd.timeout_s``: the ZMQ control plane's period, so probes agree."""
    return min(max(timeout_s / 6, 0.05), 2.0)


class StoreHeartbeat:
    """One rank's heartbeat and its view of the peers it depends on (world ranks -> how errors name them).

    The connector that owns it calls :meth:`start` once its world formed and :meth:`stop` when it closes;
    :meth:`lost` and :meth:`retire` may be called from any thread and never block.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        namespace: str,
        me: int,
        peers: Mapping[int, str],
        timeout_s: float,
        owner: str,
        watch_fence: bool = False,
        watch_drains: bool = False,
        incarnation: int = 0,
    ) -> None:
        self.address = f"tcp://{host}:{port}"
        self._host, self._port, self._timeout_s = host, port, timeout_s
        self._ns = namespace
        self._me = me
        self._incarnation = incarnation  # this process's (0 unless it rejoined a running world)
        self._inc: dict[int, int] = {}  # peers' incarnations other than 0 (readmit)
        self._readmits = 0  # bumped by readmit: a beat that began before one publishes no drains or joins
        self._peers = dict(peers)
        self._owner = owner
        self.period_s = heartbeat_period(timeout_s)
        self.limit_s = MISSED_BEATS * self.period_s
        self._lock = threading.Lock()
        self._moved: dict[int, tuple[int, float]] = {}  # world rank -> (counter, monotonic time it last moved)
        self._woke = 0.0  # monotonic time the beating thread last woke
        self._calling: float | None = None  # since when the beating thread waits in a store call
        self._retired: set[int] = set()
        self._watch_fence = watch_fence
        self._fence_out: list[str] = []  # fence keys to set, by the beating thread
        self._fenced_out: set[str] = set()  # fence keys written
        self.fenced = False
        self._drains_key = f"{namespace}/drains"  # counts drain announcements: peers' keys are read when it moves
        self._watch_drains = watch_drains
        self._drains_seen = 0
        self._announce = False  # this rank's drain, written by the next beat
        #: world ranks of the peers that announced a drain (replaced, never mutated: read from any thread)
        self.draining: frozenset[int] = frozenset()
        self._joins_key = f"{namespace}/joins"  # counts join announcements (watched with the drains)
        self._joins_seen = 0
        #: ``(world rank, incarnation)`` of the peers' new incarnations asking to rejoin (replaced, never mutated)
        self.joining: frozenset[tuple[int, int]] = frozenset()
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: object = None

    def start(self) -> None:
        """Connect to the store, beat once and start beating; ``PeerLostError`` when the store is unreachable."""
        import torch.distributed as dist

        try:
            self._store = dist.TCPStore(
                self._host,
                self._port,
                is_master=False,
                timeout=datetime.timedelta(seconds=self._timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, dist.DistStoreError) as exc:
            raise PeerLostError(
                f"{self._owner}: the world's store at {self.address} (attention rank 0) is unreachable for the "
                f"heartbeat: {exc}"
            ) from exc
        now = time.monotonic()
        with self._lock:
            self._moved = {rank: (-1, now) for rank in self._peers}
            self._woke = now
        self._stop.clear()
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"afd-cam-heartbeat-{self._me}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating. Returns within one period even when a store call hangs (the thread is a daemon)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(self.period_s)
        self._store = None

    def _peer_key(self, kind: str, rank: int) -> str:
        return rank_key(self._ns, kind, rank, self._inc.get(rank, 0))

    def retire(self, rank: int) -> None:
        """``rank`` left in order (its goodbye arrived): its silence from now on is not a loss."""
        with self._lock:
            self._retired.add(rank)

    def fence(self, rank: int) -> None:
        """Tell world rank ``rank`` (an FFN rank routed around; its incarnation now) to stop; written by the next
        beat, never blocks."""
        with self._lock:
            self._fence_out.append(self._peer_key("fenced", rank))

    def readmit(self, rank: int, incarnation: int) -> None:
        """World rank ``rank`` rejoined as ``incarnation``: watch its new keys from now on (its silence counts
        from this moment) and forget its old incarnation's drain. Never blocks; the caller's thread."""
        now = time.monotonic()
        with self._lock:
            self._inc[rank] = incarnation
            self._readmits += 1
            self._retired.discard(rank)
            self._moved[rank] = (-1, now)
            self.draining = self.draining - {rank}
            self.joining = frozenset(j for j in self.joining if j[0] != rank)
            # read both again at the next beat: the new incarnation may have announced a drain before it was admitted
            self._drains_seen = self._joins_seen = -1

    def announce_drain(self) -> None:
        """This rank is draining: its peers learn it from the next beat (never blocks; any thread)."""
        self._announce = True

    def lost_ranks(self) -> list[int]:
        """The world ranks of the peers :meth:`lost` names, for routing around them: ``[]`` while this rank's
        own store connection fails or hangs (then the peers' silence may be the store's, not theirs)."""
        calling = self._calling
        if self._error is not None or (calling is not None and time.monotonic() - calling > self.limit_s):
            return []
        return [rank for rank, _silent in self._silent()]

    def lost(self) -> list[tuple[str, float]]:
        """The peers silent for longer than :attr:`limit_s`, as ``(name, seconds silent)``; ``[]`` when none."""
        return [(self._peers[rank], silent) for rank, silent in self._silent()]

    def _silent(self) -> list[tuple[int, float]]:
        now = time.monotonic()
        with self._lock:
            if self._calling is None and now - self._woke > self.limit_s:
                # the beating thread has not run for longer than a peer may be silent, and no store call holds it:
                # this process was stopped itself; its peers are judged again once that thread has looked
                return []
            return [
                (rank, now - moved)
                for rank, (_count, moved) in self._moved.items()
                if rank not in self._retired and now - moved > self.limit_s
            ]

    def check(self, what: str) -> None:
        """``PeerLostError`` naming the first lost peer while waiting for ``what``; nothing when all are alive."""
        if self.fenced:
            raise PeerLostError(
                f"{self._owner}: the attention ranks routed around this FFN rank (its key "
                f"{rank_key(self._ns, 'fenced', self._me, self._incarnation)} is set in {self.address}) while "
                f"waiting for {what}; their experts' "
                "other holders serve them now"
            )
        lost = self.lost()
        if lost:
            name, silent = lost[0]
            why = f"; the store said: {self._error}" if self._error else ""
            raise PeerLostError(
                f"{self._owner}: {name} sent no heartbeat through {self.address} for {silent:.1f}s "
                f"(limit {self.limit_s:g}s = {MISSED_BEATS} beats of {self.period_s:g}s) while waiting for {what}{why}"
            )

    # --- the beating thread ----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            now = time.monotonic()
            with self._lock:
                if now - self._woke > self.limit_s:  # this process was stopped: the peers' silence is not theirs
                    self._moved = {rank: (count, now) for rank, (count, _moved) in self._moved.items()}
                self._woke = now
            self._beat()

    def _beat(self) -> None:
        import torch.distributed as dist

        store = self._store
        if store is None:
            return
        with self._lock:
            fences, self._fence_out = self._fence_out, []
            keys = {rank: self._peer_key("hb", rank) for rank in self._peers}
            readmits = self._readmits
        draining: frozenset[int] | None = None
        joining: frozenset[tuple[int, int]] | None = None
        mine = rank_key(self._ns, "hb", self._me, self._incarnation)
        self._calling = time.monotonic()
        try:
            for key in fences:
                store.set(key, "1")  # type: ignore[attr-defined]
                self._fenced_out.add(key)
            store.add(mine, 1)  # type: ignore[attr-defined]
            counts = {rank: int(store.add(key, 0)) for rank, key in keys.items()}  # type: ignore[attr-defined]
            if self._watch_fence and not self.fenced:
                fence = rank_key(self._ns, "fenced", self._me, self._incarnation)
                self.fenced = bool(store.check([fence]))  # type: ignore[attr-defined]
            if self._announce:
                store.set(rank_key(self._ns, "draining", self._me, self._incarnation), "1")  # type: ignore[attr-defined]
                store.add(self._drains_key, 1)  # type: ignore[attr-defined]
                self._announce = False
            if self._watch_drains:
                drains = int(store.add(self._drains_key, 0))  # type: ignore[attr-defined]
                if drains != self._drains_seen:
                    peers = [r for r in self._peers if store.check([self._peer_key("draining", r)])]  # type: ignore[attr-defined]
                    draining = frozenset(peers)
                joins = int(store.add(self._joins_key, 0))  # type: ignore[attr-defined]
                if joins != self._joins_seen:
                    joining = frozenset(self._read_joins(store))
        except (RuntimeError, dist.DistStoreError) as exc:  # the peers' silence ages; lost() reports it with this
            if self._error is None:
                logger.warning("%s: heartbeat through %s failed: %s", self._owner, self.address, exc)
            self._error = str(exc)
            with self._lock:  # written by a later beat; a fence must not be lost with a failed call
                self._fence_out[:0] = [key for key in fences if key not in self._fenced_out]
            return
        finally:
            self._calling = None
        now = time.monotonic()
        with self._lock:
            self._error = None
            if readmits == self._readmits:  # else read with an old incarnation: the next beat reads them again
                if draining is not None:
                    self.draining, self._drains_seen = draining, drains
                if joining is not None:
                    self.joining, self._joins_seen = joining, joins
            for rank, count in counts.items():
                if keys[rank] != self._peer_key("hb", rank):
                    continue  # readmitted during this beat: that count is the old incarnation's
                if self._moved.get(rank, (None, 0.0))[0] != count:
                    self._moved[rank] = (count, now)

    def _read_joins(self, store: object) -> list[tuple[int, int]]:
        """``(world rank, incarnation)`` of each peer whose announced incarnation is not the one watched now."""
        found = []
        for rank in self._peers:
            key = f"{self._ns}/joining/{rank}"
            if store.check([key]):  # type: ignore[attr-defined]
                incarnation = int(store.get(key))  # type: ignore[attr-defined]
                if incarnation > self._inc.get(rank, 0):
                    found.append((rank, incarnation))
        return found
