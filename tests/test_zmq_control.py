"""ZmqControlPlane semantics that the conformance suite hits only by timing."""

import threading

import pytest

from afd_sdk import ControlPayload, ModelFingerprint, parse_config
from afd_sdk.connector import ConnectorContext
from afd_sdk.control.plane import ZmqControlPlane, merge_payloads
from afd_sdk.errors import WireFormatError
from afd_sdk.runtime.world import free_port_block

FP = ModelFingerprint("X", 8, "float32", 2)


def planes(num_attention: int):
    port = free_port_block(4)
    common = {"port": port, "num_attention_ranks": num_attention, "timeout_s": 5}
    ffn = ZmqControlPlane(ConnectorContext(parse_config({**common, "role": "ffn"}), 0, FP), connector_name="T")
    attn = [
        ZmqControlPlane(ConnectorContext(parse_config({**common, "role": "attention"}), r, FP), connector_name="T")
        for r in range(num_attention)
    ]
    threads = [threading.Thread(target=p.init) for p in attn]
    for t in threads:
        t.start()
    ffn.init()
    for t in threads:
        t.join(10)
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
