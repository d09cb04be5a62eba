"""``P2pNcclAFDConnector``'s call pattern without its contract: the ``posted`` baseline of ``afd bench connector``.

The ``gloo`` baseline waits each operation before it starts the next:
``send().wait()``, then ``recv().wait()``. The connector cannot: a send must
not wait for the peer to receive (the runner sends every stage of a layer
before it receives any), so it leaves the send in flight, posts the receive,
and completes both in ``recv_ffn_output``; the FFN side completes its previous
send before it posts the next receive, into the same buffer. This baseline makes
exactly those process-group calls, on the same kind of group, with no check, no
plan and no bookkeeping. So ``connector ÷ posted`` is what the contract costs,
and ``posted ÷ gloo`` what that call pattern costs on the transport.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from afd_sdk.bench.connector_bench import RawGloo

__all__ = ["RawGlooPosted"]


class RawGlooPosted(RawGloo):
    """Gloo send/recv in the connector's order; see the module docstring."""

    def attention_round_trip(self, payload: torch.Tensor) -> Callable[[], None]:
        back = torch.empty_like(payload)
        pg, peer = self.pg, self.peer

        def rt() -> None:
            sent = pg.send([payload], peer, 0)
            got = pg.recv([back], peer, 0)
            sent.wait()
            got.wait()

        return rt

    def ffn_echo(self, count: int, nbytes: int) -> None:
        buf = torch.empty(nbytes // 4, dtype=torch.float32)
        pg, peer = self.pg, self.peer
        sent = None
        for _ in range(count):
            if sent is not None:
                sent.wait()
            pg.recv([buf], peer, 0).wait()
            sent = pg.send([buf], peer, 0)
        if sent is not None:
            sent.wait()
