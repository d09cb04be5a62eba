"""torch.distributed pieces shared by the point-to-point connectors (p2p, CAM portable).

Groups are built directly on a store — one per micro-batch stage, so
concurrent stage threads never share a communicator — and the default
process group, which a serving engine owns, is never touched.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Any

from afd_sdk.errors import PeerLostError

__all__ = ["shutdown_groups", "stage_groups", "wait_works"]

logger = logging.getLogger(__name__)


def stage_groups(
    store: Any, prefix: str, rank: int, size: int, backend: str, timeout_s: float, num_stages: int
) -> list[Any]:
    """One ``ProcessGroupGloo`` (``backend="gloo"``) or ``ProcessGroupNCCL`` per stage, on ``store``."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    groups = []
    for s in range(num_stages):
        prefixed = dist.PrefixStore(f"{prefix}/stage{s}", store)
        if backend == "gloo":
            groups.append(dist.ProcessGroupGloo(prefixed, rank, size, timeout))
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            groups.append(dist.ProcessGroupNCCL(prefixed, rank, size, opts))
    return groups


def shutdown_groups(groups: Sequence[Any], owner: str) -> None:
    """Shut every group down; a group whose peer died cannot, and dropping it frees it."""
    for pg in groups:
        shutdown = getattr(pg, "shutdown", None)
        if shutdown is None:
            continue
        try:
            shutdown()
        except RuntimeError as exc:
            logger.debug("%s: process group shutdown failed: %s", owner, exc)


def wait_works(works: Sequence[Any], timeout_s: float, what: str) -> None:
    """Wait for every work handle; a failure or timeout is ``PeerLostError`` naming ``what``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for work in works:
        try:
            work.wait(timeout)
        except RuntimeError as exc:
            raise PeerLostError(f"{what} failed or timed out after {timeout_s:g}s: {exc}") from exc
