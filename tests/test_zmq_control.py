"""ZmqControlPlane semantics that the conformance suite hits only by timing."""

import threading
import time

import pytest

from afd_sdk import ControlPayload, ModelFingerprint, parse_config
from afd_sdk.connector import ConnectorContext
from afd_sdk.control.plane import ZmqControlPlane, merge_payloads
from afd_sdk.errors import PeerLostError, WireFormatError
from afd_sdk.runtime.world import free_port_block
from afd_sdk.testing import init_in_threads

FP = ModelFingerprint("X", 8, "float32", 2)


def planes(num_attention: int, **afd):
    port = free_port_block(4)
    common = {"port": port, "num_attention_ranks": num_attention, "timeout_s": 5, **afd}
    ffn = ZmqControlPlane(ConnectorContext(parse_config({**common, "role": "ffn"}), 0, FP), connector_name="T")
    attn = [
        ZmqControlPlane(ConnectorContext(parse_config({**common, "role": "attention"}), r, FP), connector_name="T")
        for r in range(num_attention)
    ]
    init_in_threads(ffn, attn, timeout_s=10)
    return ffn, attn


def step(k: int, n: int) -> ControlPayload:
    return ControlPayload(k, ((n,),), n, 2)


def test_peer_racing_ahead_is_queued_in_order():
    ffn, (a0, a1) = planes(2)
    try:
        a1.send(step(0, 0))  # a1's stages were all empty: it finished step 0 at once
        a1.send(step(1, 5))
        a0.send(step(0, 3))
        first = ffn.recv(timeout_s=5)
        assert first.step_idx == 0 and first.stage_token_counts == ((3, 0),)
        a0.send(step(1, 4))
        second = ffn.recv(timeout_s=5)
        assert second.step_idx == 1 and second.stage_token_counts == ((4, 5),)
        a0.close()
        a1.close()
        assert ffn.recv(timeout_s=5) is None  # every peer said goodbye: orderly end
    finally:
        for p in (ffn, a0, a1):
            p.close()


def test_merge_rejects_disagreeing_peers():
    with pytest.raises(WireFormatError, match="disagree on num_layers"):
        merge_payloads([ControlPayload(0, ((1,),), 1, 2), ControlPayload(0, ((1,),), 1, 3)])


def _plane(common: dict, role: str, rank: int = 0) -> ZmqControlPlane:
    return ZmqControlPlane(ConnectorContext(parse_config({**common, "role": role}), rank, FP), connector_name="T")


@pytest.mark.parametrize("first", ["ffn", "attention"])
def test_either_side_may_start_long_after_the_exchange_deadline(first):
    common = {"port": free_port_block(4), "timeout_s": 0.3, "connect_timeout_s": 20}
    early, late = _plane(common, first), _plane(common, "attention" if first == "ffn" else "ffn")
    errors: list[BaseException] = []

    def init_early() -> None:
        try:
            early.init()
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=init_early)
    t.start()
    try:
        time.sleep(1.5)  # five exchange deadlines: the early side must still be waiting
        late.init()
        t.join(10)
        assert not t.is_alive() and not errors, errors
    finally:
        t.join(10)
        for p in (early, late):
            p.close()


def test_rendezvous_gives_up_after_connect_timeout_naming_the_key():
    common = {"port": free_port_block(4), "timeout_s": 30, "connect_timeout_s": 0.5}
    ffn = _plane(common, "ffn")
    t0 = time.monotonic()
    with pytest.raises(PeerLostError, match=r"hello of attention ranks \[0\].*afd.connect_timeout_s=0.5s"):
        ffn.init()
    assert time.monotonic() - t0 < 5
    ffn.close()
