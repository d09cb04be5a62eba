"""``P2pNcclAFDConnector`` on Gloo, in one process, through each wire (native C++ and Python): every check holds
in the steady state, and each new step is checked against what it announced."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from afd_connectors.p2p import connector as p2p_connector
from afd_connectors.p2p.wire import native_wire_problem
from afd_sdk.config import parse_config
from afd_sdk.errors import AFDConfigError, ConnectorError
from afd_sdk.plugins import get_plugin_manager
from afd_sdk.runtime.attention_runner import announce_step
from afd_sdk.runtime.session import connector_from_spec
from afd_sdk.runtime.world import free_port_block
from afd_sdk.testing import init_in_threads
from afd_sdk.wire import ControlPayload, TransferMetadata

HIDDEN = 16


def _announce(attn, ffn, step: int, tokens: int) -> None:
    announce_step(attn, ControlPayload(step, ((tokens,), (tokens,)), tokens, 8))
    cp = ffn.require_control_plane()
    cp.apply(cp.recv(timeout_s=5))


NOT_BUILT = pytest.mark.skipif(
    native_wire_problem() is not None, reason=f"the native wire is not built here: {native_wire_problem()}"
)
NATIVE = pytest.param("native", marks=NOT_BUILT)


def _live_pair(wire: str):
    port = free_port_block(16)
    spec = {
        "afd": {
            "connector": "p2p",
            "port": port,
            "timeout_s": 5,
            "num_stages": 2,
            "connector_extra_config": {"wire": wire},
        },
        "model": {"architecture": "T", "hidden_size": HIDDEN, "dtype": "float32", "num_layers": 8},
        "max_num_tokens": 8,
    }
    ffn = connector_from_spec({**spec, "role": "ffn", "rank": 0})
    attn = connector_from_spec({**spec, "role": "attention", "rank": 0})
    init_in_threads(ffn, [attn], timeout_s=10)
    assert (attn.wire_name, ffn.wire_name) == (wire, wire)
    _announce(attn, ffn, 0, 2)
    return attn, ffn


@pytest.fixture(params=[NATIVE, "python"])
def pair(request):
    """A live p2p (Gloo) attention/FFN pair in this process, two stages, one step of 2 tokens announced."""
    attn, ffn = _live_pair(request.param)
    yield attn, ffn
    attn.close()
    ffn.close()


def _round_trip(attn, ffn, x: torch.Tensor, layer: int, stage: int = 0) -> int:
    """One exchange; the layer index the FFN side saw."""
    attn.send_attn_output(x, TransferMetadata(layer, stage, (x.shape[0],)))
    got = ffn.recv_attn_output(stage)
    ffn.send_ffn_output(got.hidden_states + 1, got.metadata)
    assert torch.equal(attn.recv_ffn_output(x, stage), x + 1)
    return got.metadata.layer_idx


def test_checks_still_refuse_misuse_after_a_run_of_exchanges(pair):
    attn, ffn = pair
    x = torch.randn(2, HIDDEN)
    for layer in range(3):
        _round_trip(attn, ffn, x, layer)
    md = TransferMetadata(3, 0, (2,))
    with pytest.raises(ConnectorError, match="without a preceding send_attn_output"):
        attn.recv_ffn_output(x, 0)
    with pytest.raises(ConnectorError, match=r"hidden_states \[2, 17\]"):
        attn.send_attn_output(torch.randn(2, HIDDEN + 1), md)
    with pytest.raises(ConnectorError, match=r"hidden_states is torch.float64"):
        attn.send_attn_output(x.double(), md)
    with pytest.raises(ConnectorError, match=r"send_ffn_output\(\) is a ffn-side call"):
        attn.send_ffn_output(x, md)
    with pytest.raises(ConnectorError, match=r"send_attn_output\(\) is a attention-side call"):
        ffn.send_attn_output(x, md)
    with pytest.raises(ConnectorError, match=r"recv_attn_output\(\) is a ffn-side call"):
        attn.recv_attn_output(0)
    attn.send_attn_output(x, md)
    with pytest.raises(ConnectorError, match="stage 0 already has a send awaiting"):
        attn.send_attn_output(x, md)  # a send that succeeded just before, while its own is pending
    got = ffn.recv_attn_output(0)
    with pytest.raises(ConnectorError, match="ffn output shape"):
        ffn.send_ffn_output(torch.randn(3, HIDDEN), got.metadata)
    ffn.send_ffn_output(got.hidden_states, got.metadata)
    assert torch.equal(attn.recv_ffn_output(x, 0), x)


def test_each_new_step_is_checked_and_restarts_the_layer_count(pair):
    attn, ffn = pair
    x = torch.randn(2, HIDDEN)
    assert [_round_trip(attn, ffn, x, layer) for layer in range(3)] == [0, 1, 2]
    assert _round_trip(attn, ffn, x, 0, stage=1) == 0
    _announce(attn, ffn, 1, 2)  # the same token counts: the layers count from 0 again
    assert [_round_trip(attn, ffn, x, layer) for layer in range(3)] == [0, 1, 2]
    _announce(attn, ffn, 2, 3)  # 3 tokens announced: a 2-token send no longer fits, every time
    for _ in range(2):
        with pytest.raises(ConnectorError, match="2 tokens sent for stage 0; the step announced 3"):
            attn.send_attn_output(x, TransferMetadata(0, 0, (2,)))
    y = torch.randn(3, HIDDEN)
    assert [_round_trip(attn, ffn, y, layer) for layer in range(2)] == [0, 1]
    announce_step(attn, ControlPayload(3, ((2,),), 2, 8))  # one stage this step: stage 1 is out of range
    for _ in range(2):
        with pytest.raises(ConnectorError, match="stage_idx=1 but the step announced 1 stages"):
            attn.send_attn_output(x, TransferMetadata(0, 1, (2,)))


def test_calls_after_close_are_refused(pair):
    attn, ffn = pair
    x = torch.randn(2, HIDDEN)
    _round_trip(attn, ffn, x, 0)
    attn.close()
    ffn.close()
    with pytest.raises(ConnectorError, match="init"):
        attn.send_attn_output(x, TransferMetadata(1, 0, (2,)))
    with pytest.raises(ConnectorError, match="init"):
        ffn.recv_attn_output(0)


def test_the_receive_is_posted_with_the_send_and_the_last_output_stays_valid(pair):
    attn, ffn = pair
    x1, x2 = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
    attn.send_attn_output(x1, TransferMetadata(0, 0, (2,)))
    got = ffn.recv_attn_output(0)
    ffn.send_ffn_output(got.hidden_states * 2, got.metadata)
    out1 = attn.recv_ffn_output(x1, 0)
    assert torch.equal(out1, x1 * 2)
    attn.send_attn_output(x2, TransferMetadata(1, 0, (2,)))  # posts the receive of layer 1's output now
    got = ffn.recv_attn_output(0)
    ffn.send_ffn_output(got.hidden_states * 3, got.metadata)
    time.sleep(0.3)  # Gloo's loop thread lands layer 1's output meanwhile, in the other buffer
    assert torch.equal(out1, x1 * 2)  # valid until the next recv_ffn_output of the stage, as the contract says
    assert torch.equal(attn.recv_ffn_output(x2, 0), x2 * 3)


def test_a_wrong_ref_tensor_is_refused_and_the_output_still_arrives(pair):
    attn, ffn = pair
    x = torch.randn(2, HIDDEN)
    attn.send_attn_output(x, TransferMetadata(0, 0, (2,)))
    got = ffn.recv_attn_output(0)
    ffn.send_ffn_output(got.hidden_states + 5, got.metadata)
    with pytest.raises(ConnectorError, match=r"ref_tensor is torch.float32\[3, 16\].*expected torch.float32\[2, 16\]"):
        attn.recv_ffn_output(torch.randn(3, HIDDEN), 0)
    with pytest.raises(ConnectorError, match=r"ref_tensor is torch.float64\[2, 16\]"):
        attn.recv_ffn_output(x.double(), 0)
    assert torch.equal(attn.recv_ffn_output(x, 0), x + 5)


def test_the_python_cost_script_times_every_call():
    script = Path(__file__).resolve().parents[1] / "scripts" / "p2p_python_cost.py"
    done = subprocess.run([sys.executable, str(script), "--steps", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for call in ("attention send", "attention receive", "ffn receive", "ffn send", "round trip"):
        assert re.search(rf"^{call} +[0-9.]+ µs$", done.stdout, re.MULTILINE), done.stdout


@pytest.mark.parametrize(("wire", "slow_sends"), [pytest.param("native", 2, marks=NOT_BUILT), ("python", 2 * 8)])
def test_the_steady_state_runs_without_the_python_checks(wire, slow_sends, monkeypatch):
    """The native wire checks every send itself after the first of each stage; the Python wire once per
    (layer, stage) while the token counts repeat. Counted over 3 steps of 8 layers and 2 stages."""
    attn, ffn = _live_pair(wire)
    calls = []
    check = type(attn).check_attn_send
    monkeypatch.setattr(type(attn), "check_attn_send", lambda self, *a: calls.append(a) or check(self, *a))
    try:
        x = torch.randn(2, HIDDEN)
        for step in range(3):
            if step:
                _announce(attn, ffn, step, 2)
            for layer in range(8):
                for stage in (0, 1):
                    assert _round_trip(attn, ffn, x * (layer + 1), layer, stage) == layer
        assert len(calls) == slow_sends
    finally:
        attn.close()
        ffn.close()


def test_wire_native_where_it_is_not_built_is_a_config_error(monkeypatch):
    monkeypatch.setattr(p2p_connector, "native_wire_problem", lambda: "afd_connectors.p2p._p2pwire does not import")
    cfg = parse_config({"connector": "p2p", "role": "ffn", "connector_extra_config": {"wire": "native"}})
    with pytest.raises(
        AFDConfigError,
        match=r"wire='native' cannot run here \(afd_connectors.p2p._p2pwire does not "
        r"import\).*--no-build-isolation",
    ) as err:
        get_plugin_manager().resolve_config(cfg)
    assert err.value.key == "afd.connector_extra_config.wire"
    auto = parse_config({"connector": "p2p", "role": "ffn", "connector_extra_config": {"wire": "auto"}})
    get_plugin_manager().resolve_config(auto)  # auto falls back to the Python wire instead


@NOT_BUILT
def test_auto_picks_the_native_wire_where_it_is_built():
    attn, ffn = _live_pair("native")
    attn.close()
    ffn.close()
    port = free_port_block(16)
    spec = {
        "afd": {"connector": "p2p", "port": port, "timeout_s": 5},
        "model": {"architecture": "T", "hidden_size": HIDDEN, "dtype": "float32", "num_layers": 1},
    }
    ffn = connector_from_spec({**spec, "role": "ffn", "rank": 0})
    attn = connector_from_spec({**spec, "role": "attention", "rank": 0})
    init_in_threads(ffn, [attn], timeout_s=10)
    try:
        assert (attn.wire_name, ffn.wire_name) == ("native", "native")
    finally:
        attn.close()
        ffn.close()
