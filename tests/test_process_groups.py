"""``wait_works``: the wait every torch.distributed data path makes per layer."""

from __future__ import annotations

import pytest

from afd_sdk.control import wait_works
from afd_sdk.errors import PeerLostError


class _Work:
    def __init__(self, error: str | None = None) -> None:
        self.error = error
        self.timeouts: list[object] = []

    def wait(self, timeout: object) -> bool:
        self.timeouts.append(timeout)
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


def test_completed_works_format_nothing():
    works = [_Work(), _Work()]
    # "%d" with a str would raise TypeError if it were formatted: success must not format the message
    wait_works(works, 5.0, "hidden states of layer %d", "not an int")
    assert all(len(w.timeouts) == 1 for w in works)
    assert works[0].timeouts[0] is works[1].timeouts[0]  # one cached timedelta per timeout value


def test_a_failed_work_is_peer_lost_with_the_formatted_message():
    with pytest.raises(PeerLostError, match=r"hidden states of layer 3, stage 1 failed or timed out after 2s: gone"):
        wait_works([_Work(), _Work("gone")], 2.0, "hidden states of layer %d, stage %d", 3, 1)


def test_a_plain_message_is_used_as_is():
    with pytest.raises(PeerLostError, match=r"^send of 100% of it failed"):
        wait_works([_Work("x")], 1.0, "send of 100% of it")
