"""One FFN process serving several independent AFD worlds with one copy of its weights.

Independent serving engines (``vllm serve`` instances, each with its own
requests) step on their own schedule. In one world, the FFN side merges one
step announcement per attention rank, so an idle engine would hold up the
others. Giving each engine its own world (its own ``afd.port``) and serving
all of them from one FFN process keeps the weights shared and lets every
engine step alone: each world runs its own server loop in a thread, and the
FFN compute is serialised by a lock (vLLM's forward context is
process-global; torch's kernels are multi-threaded underneath anyway).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from afd_sdk.config import AFDConfig
from afd_sdk.connector import ConnectorBase
from afd_sdk.errors import AFDConfigError, DrainedError
from afd_sdk.metrics import AFDMetrics, MetricsHub, tracking
from afd_sdk.runtime.drain import Drain
from afd_sdk.runtime.stats import ServeStats

logger = logging.getLogger(__name__)

__all__ = ["SerializedFFN", "WorldOutcome", "serve_worlds", "served", "world_configs"]


def world_configs(config: AFDConfig, ports: Sequence[int]) -> list[AFDConfig]:
    """``config`` once per port (``afd.port`` replaced); ``[config]`` when ``ports`` is empty.

    Each world's connector uses a few ports from its ``afd.port`` (zmq:
    ``num_ffn_ranks × (1 + num_stages)``; p2p: one more for its store; an FFN
    replica's beacon ``num_ffn_ranks`` more), so worlds' ports must be apart;
    the ports must be distinct.
    """
    if not ports:
        return [config]
    if len(set(ports)) != len(ports):
        raise AFDConfigError(
            f"world ports {list(ports)} repeat a port; expected distinct ports, one per world",
            key="ports",
            value=list(ports),
        )
    return [config.replace(port=p) for p in ports]


class SerializedFFN:
    """An FFN callable ``(layer_idx, hidden_states, extras) -> output`` that one world's thread runs at a time."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        with self.lock:
            return self.fn(*args)


@dataclass
class WorldOutcome:
    """How one world's serving ended: its stats, or the error that ended it."""

    port: int
    stats: ServeStats | None = None
    error: BaseException | None = None


def serve_worlds(
    connectors: Sequence[ConnectorBase],
    model: Callable[..., Any],
    *,
    max_steps: int | None = None,
    on_ready: Callable[[int], None] | None = None,
    on_done: Callable[[WorldOutcome], None] | None = None,
    hub: MetricsHub | None = None,
    drain: Drain | None = None,
) -> list[WorldOutcome]:
    """Initialise and serve every connector (one world each) until each world ends; close them all.

    ``model`` is the FFN callable the role's server loop takes (see
    :func:`afd_sdk.runtime.serve.server_for`). One world runs in the calling
    thread; several run in one thread each, sharing ``model`` through
    :class:`SerializedFFN`. A world that fails (a peer lost) ends alone; the
    others keep serving. ``on_ready(port)`` runs when a world's handshake is
    done, ``on_done(outcome)`` when the world ended (goodbye, ``max_steps`` or error).
    With ``hub``, each world records its exchanges and its peers' state there
    (one :class:`~afd_sdk.metrics.AFDMetrics` per world, for ``/metrics`` and ``/readyz``).
    With ``drain``, each world's control plane stops at the next step boundary once it is requested.
    """
    from afd_sdk.runtime.serve import server_for

    outcomes = [WorldOutcome(c.config.port) for c in connectors]
    shared = model if len(connectors) == 1 else SerializedFFN(model)
    recorders = [None if hub is None else hub.for_connector(c) for c in connectors]

    def run(conn: ConnectorBase, out: WorldOutcome, rec: AFDMetrics | None) -> None:
        try:
            with tracking(rec) as connected:
                if drain is not None:
                    drain.attach(conn)  # before init: a world still waiting for its peers can be drained
                try:
                    conn.init()
                except DrainedError as exc:  # drained before any attention peer came: an orderly end
                    logger.warning("world at port %d: %s", out.port, exc)
                    out.stats = ServeStats()
                    return
                connected()
                if on_ready is not None:
                    on_ready(out.port)
                out.stats = server_for(conn, shared, max_steps=max_steps, metrics=rec).serve()
        except Exception as exc:  # recorded per world; the caller reports every world's outcome
            logger.error("world at port %d ended with %s: %s", out.port, type(exc).__name__, exc)
            out.error = exc
        finally:
            conn.close()
            if on_done is not None:
                on_done(out)

    if len(connectors) == 1:
        run(connectors[0], outcomes[0], recorders[0])
    else:
        threads = [
            threading.Thread(target=run, args=(c, o, r), name=f"afd-world-{o.port}", daemon=True)
            for c, o, r in zip(connectors, outcomes, recorders, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.5)  # short joins: the main thread stays responsive to signals
    if drain is not None and drain.requested and all(o.error is None for o in outcomes):
        drain.finish()
    return outcomes


def served(outcomes: Sequence[WorldOutcome]) -> list[ServeStats]:
    """Every world's stats; raises the first world's error (each was logged when its world ended)."""
    for out in outcomes:
        if out.error is not None:
            raise out.error
    return [out.stats for out in outcomes if out.stats is not None]
