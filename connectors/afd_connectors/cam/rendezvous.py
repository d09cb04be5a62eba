"""Rendezvous and handshake of a CAM world over one ``TCPStore`` (both backends).

Attention rank 0 (world rank 0) hosts the store at ``afd.port``. Every rank
publishes a msgpack :class:`CamHello` and reads every other rank's; each
Attention/FFN pair is compared field by field, so both sides of a mismatch
raise the same ``HandshakeError`` before any process group exists.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

import msgspec

from afd_sdk.control import compare_hellos, open_tcp_store
from afd_sdk.errors import HandshakeError, PeerLostError, WireFormatError
from afd_sdk.wire import PROTOCOL_VERSION, Hello

if TYPE_CHECKING:
    from afd_connectors.cam.backend import CamHost

__all__ = ["CamHello", "open_store"]


class CamHello(msgspec.Struct, frozen=True):
    """One rank's hello: the common :class:`~afd_sdk.wire.Hello` plus the routing both sides must share."""

    hello: Hello
    world_rank: int
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    backend: str


_CAM_FIELDS = ("num_experts", "top_k", "moe_layers", "backend")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(CamHello)


def _hello(conn: CamHost) -> CamHello:
    cfg = conn.config
    d = conn.describe()
    return CamHello(
        Hello(
            PROTOCOL_VERSION,
            cfg.role,
            conn.role_rank,
            cfg.num_attention_ranks,
            cfg.num_ffn_ranks,
            conn.name,
            conn.context.model,
            cfg.num_stages,
        ),
        conn.world_rank,
        d["num_experts"],
        d["top_k"],
        tuple(d["moe_layers"]),
        d["backend"],
    )


def _compare(attention: CamHello, ffn: CamHello) -> tuple[str, str, str] | None:
    diff = compare_hellos(attention.hello, ffn.hello)
    if diff is not None:
        return diff
    for name in _CAM_FIELDS:
        a, f = getattr(attention, name), getattr(ffn, name)
        if a != f:
            return name, str(a), str(f)
    return None


def open_store(conn: CamHost, namespace: str) -> Any:
    """Open the world's ``TCPStore`` and run the handshake; returns the store.

    Raises ``PeerLostError`` when a rank does not arrive within ``connect_timeout_s``
    and ``HandshakeError`` on the first field an Attention/FFN pair disagrees on.
    """
    import torch.distributed as dist

    cfg = conn.config
    world = conn.world
    me = conn.world_rank
    store = open_tcp_store(
        cfg.host, cfg.port, world.world_size, me == 0, cfg.connect_timeout_s, f"{conn.name} (afd.connect_timeout_s)"
    )
    mine = _hello(conn)
    store.set(f"{namespace}/hello/{me}", _encoder.encode(mine))
    for rank in range(world.world_size):
        if rank == me:
            continue
        try:
            raw = store.get(f"{namespace}/hello/{rank}")
        except (RuntimeError, dist.DistStoreError) as exc:
            raise PeerLostError(
                f"{conn.name}: world rank {rank} sent no hello within afd.connect_timeout_s={cfg.connect_timeout_s:g}s"
            ) from exc
        try:
            theirs = _decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireFormatError(f"{conn.name}: malformed hello of world rank {rank}: {exc}") from exc
        if theirs.hello.role == mine.hello.role:
            continue  # same-role ranks meet through their peers of the other role
        pair = (mine, theirs) if mine.hello.role == "attention" else (theirs, mine)
        diff = _compare(*pair)
        if diff is not None:
            raise HandshakeError(*diff)
    store.set_timeout(datetime.timedelta(seconds=cfg.timeout_s))  # every rank is here: later waits use timeout_s
    return store
