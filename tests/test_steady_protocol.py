"""The built-in native steady states follow afd_sdk.control.SteadyState: the contract's calls, each served (the
send record updated) or declined having changed nothing, so the checked Python path raises the shared errors."""

from __future__ import annotations

import pytest
import torch

from afd_connectors import native
from afd_sdk.control import AttentionSteadyState, FFNSteadyState, SteadyState
from afd_sdk.errors import ConnectorError
from afd_sdk.runtime.session import connector_from_spec
from afd_sdk.runtime.world import free_port_block
from afd_sdk.testing import init_in_threads
from afd_sdk.wire import TransferMetadata

HIDDEN = 16


def _built(module: str):
    problem = native.load(module)[1]
    return pytest.mark.skipif(problem is not None, reason=f"the native steady state is not built here: {problem}")


def _pair(connector: str, extra: dict | None = None):
    spec = {
        "afd": {
            "connector": connector,
            "port": free_port_block(8),
            "timeout_s": 5,
            "connector_extra_config": extra or {},
        },
        "model": {"architecture": "T", "hidden_size": HIDDEN, "dtype": "float32", "num_layers": 2},
        "max_num_tokens": 8,
    }
    ffn = connector_from_spec({**spec, "role": "ffn", "rank": 0})
    attn = connector_from_spec({**spec, "role": "attention", "rank": 0})
    init_in_threads(ffn, [attn], timeout_s=10)
    return attn, ffn


@pytest.mark.parametrize(
    "connector",
    [pytest.param("zmq", marks=_built("zmq._zmqsteady")), pytest.param("shm", marks=_built("shm._shmsteady"))],
)
def test_the_steady_state_serves_or_declines_having_changed_nothing(connector):
    attn, ffn = _pair(connector)
    try:
        for side in (attn, ffn):
            assert isinstance(side._steady, SteadyState), type(side._steady)
        x = torch.ones(2, HIDDEN)
        md = TransferMetadata(0, 0, (2,))
        steady = attn._steady
        # what no steady state may serve: a wrong shape, a receive without a send
        assert steady.attn_send(torch.ones(2, HIDDEN + 1), md) is False and attn.sends == {}
        assert steady.attn_recv(x, 0) is None and attn.sends == {}
        for step in range(2):  # the first step teaches it every (layer, stage, tokens); the second is served
            for layer in range(2):
                md = TransferMetadata(layer, 0, (2,))
                served = steady.attn_send(x, md)
                if step == 1:
                    assert served is True, (connector, layer)
                assert attn.sends == ({0: (layer, 2)} if served else {})
                if not served:
                    attn.send_attn_output(x, md)
                # a second send on the stage: declined with nothing changed, then the checked path's shared error
                assert steady.attn_send(x, md) is False and attn.sends == {0: (layer, 2)}
                with pytest.raises(ConnectorError, match="already has a send awaiting"):
                    attn.send_attn_output(x, md)
                got = ffn.recv_attn_output(0)
                ffn.send_ffn_output(got.hidden_states * 2, got.metadata)
                assert torch.equal(attn.recv_ffn_output(x, 0), x * 2) and attn.sends == {}
    finally:
        attn.close()
        ffn.close()


@_built("p2p._p2pwire")
def test_p2p_native_wire_serves_the_attention_half_only():
    attn, ffn = _pair("p2p", {"wire": "native"})
    try:
        assert isinstance(attn._wire, AttentionSteadyState)
        assert not isinstance(attn._wire, FFNSteadyState)  # its FFN side is wire primitives under Python's checks
    finally:
        attn.close()
        ffn.close()
