"""The ZMQ connector's steady-state framing: cached headers, and forged headers still caught."""

import msgspec
import pytest
import torch

from afd_connectors.zmq import connector as zmq_connector
from afd_connectors.zmq.wire import native_wire_problem, steady_problem
from afd_sdk.control import HeaderCache
from afd_sdk.errors import ConnectorError, WireFormatError
from afd_sdk.runtime.attention_runner import announce_step
from afd_sdk.runtime.session import connector_from_spec
from afd_sdk.runtime.world import free_port_block
from afd_sdk.testing import init_in_threads
from afd_sdk.wire import ControlPayload, TensorHeader, TensorSpec, TransferMetadata, encode_header

HIDDEN = 16


def _header(layer: int, n: int = 2, kind: str = "a2f", stage: int = 0) -> TensorHeader:
    name = "hidden_states" if kind == "a2f" else "ffn_output"
    return TensorHeader(kind, layer, stage, (n,), (TensorSpec(name, "float32", (n, HIDDEN)),))


def test_header_cache_builds_each_key_once_and_is_bounded():
    cache = HeaderCache(limit=2)
    built = []

    def build(layer: int) -> TensorHeader:
        built.append(layer)
        return _header(layer)

    first = cache.encoded((0,), lambda: build(0))
    assert cache.encoded((0,), lambda: build(0)) is first and built == [0]
    assert first == encode_header(_header(0))
    cache.encoded((1,), lambda: build(1))
    cache.encoded((2,), lambda: build(2))  # the limit clears the map: key 0 is built again
    cache.encoded((0,), lambda: build(0))
    assert built == [0, 1, 2, 0]


def test_header_cache_remembers_only_valid_headers():
    cache = HeaderCache()
    calls = []

    def validate(header: TensorHeader) -> str | None:
        calls.append(header.layer_idx)
        return "layer 7 is not served" if header.layer_idx == 7 else None

    good, bad = encode_header(_header(1)), encode_header(_header(7))
    assert cache.decoded(good, validate) == _header(1)
    assert cache.decoded(good, validate) == _header(1) and calls == [1]  # validated once
    for _ in range(2):
        with pytest.raises(WireFormatError, match="layer 7 is not served"):
            cache.decoded(bad, validate)
    assert calls == [1, 7, 7]  # an invalid header is checked every time
    with pytest.raises(WireFormatError, match="malformed tensor header"):
        cache.decoded(b"\xc1", validate)


WIRES = ["native", "pyzmq"] if native_wire_problem() is None else ["pyzmq"]
#: the pair fixture's data paths: each wire, and the native wire without its C++ steady state (afd_connectors.
#: _zmqsteady is a torch extension: an isolated build, as vLLM's venv makes, has the wire without it)
PATHS = [*WIRES, "native-python-steady"] if steady_problem() is None else WIRES


def _live_pair(attn_wire: str, ffn_wire: str):
    port = free_port_block(16)
    spec = {
        "afd": {"connector": "zmq", "port": port, "timeout_s": 5, "num_stages": 2},
        "model": {"architecture": "T", "hidden_size": HIDDEN, "dtype": "float32", "num_layers": 8},
        "max_num_tokens": 8,
    }

    def build(role: str, wire: str):
        afd = {**spec["afd"], "connector_extra_config": {"wire": wire}}
        return connector_from_spec({**spec, "afd": afd, "role": role, "rank": 0})

    ffn, attn = build("ffn", ffn_wire), build("attention", attn_wire)
    assert (attn.wire_name, ffn.wire_name) == (attn_wire, ffn_wire)
    init_in_threads(ffn, [attn], timeout_s=10)
    return attn, ffn


@pytest.fixture(params=PATHS)
def pair(request, monkeypatch):
    """A live zmq attention/FFN pair in this process, two stages, with one step of 8 layers announced."""
    wire = request.param
    if wire == "native-python-steady":
        wire = "native"
        monkeypatch.setattr(zmq_connector, "make_steady", lambda *args: None)
    attn, ffn = _live_pair(wire, wire)
    expect_steady = request.param == "native" and steady_problem() is None
    assert (attn._steady is not None, ffn._steady is not None) == (expect_steady, expect_steady)
    announce_step(attn, ControlPayload(0, ((2,), (2,)), 2, 8))
    cp = ffn.require_control_plane()
    cp.apply(cp.recv(timeout_s=5))
    yield attn, ffn
    attn.close()
    ffn.close()


def _forge_f2a(ffn, frames):
    ffn._data[0].sock.send_multipart([b"a0", *frames])


def test_attention_checks_f2a_headers_it_has_not_seen_byte_for_byte(pair):
    attn, ffn = pair
    x = torch.randn(2, HIDDEN)
    # a round trip through both connectors: the byte-equal fast path
    attn.send_attn_output(x, TransferMetadata(0, 0, (2,)))
    got = ffn.recv_attn_output(0)
    ffn.send_ffn_output(got.hidden_states * 2, got.metadata)
    assert torch.equal(attn.recv_ffn_output(x, 0), x * 2)

    # the same header with the layer as a 2-byte int: other bytes, equal header -> accepted, value-exact
    attn.send_attn_output(x, TransferMetadata(1, 0, (2,)))
    ffn.recv_attn_output(0)
    plain = encode_header(_header(1, kind="f2a"))
    wide = plain.replace(b"\xa3f2a\x01", b"\xa3f2a\xcd\x00\x01", 1)
    assert wide != plain and msgspec.msgpack.decode(wide, type=TensorHeader) == _header(1, kind="f2a")
    _forge_f2a(ffn, [wide, (x * 3).numpy().tobytes()])
    assert torch.equal(attn.recv_ffn_output(x, 0), x * 3)

    # a header for another layer -> the error names what differs
    attn.send_attn_output(x, TransferMetadata(2, 0, (2,)))
    ffn.recv_attn_output(0)
    _forge_f2a(ffn, [encode_header(_header(5, kind="f2a")), x.numpy().tobytes()])
    with pytest.raises(ConnectorError, match=r"\(shape, dtype, layer, stage\)=\(\(2, 16\), 'float32', 5, 0\)"):
        attn.recv_ffn_output(x, 0)

    # the expected header but no tensor frame behind it
    attn.send_attn_output(x, TransferMetadata(3, 0, (2,)))
    ffn.recv_attn_output(0)
    _forge_f2a(ffn, [encode_header(_header(3, kind="f2a"))])
    with pytest.raises(WireFormatError, match="0 tensor frame"):
        attn.recv_ffn_output(x, 0)


def test_ffn_checks_stage_and_layer_of_remembered_headers(pair):
    attn, ffn = pair
    x = torch.randn(2, HIDDEN)
    attn.send_attn_output(x, TransferMetadata(0, 1, (2,)))
    got = ffn.recv_attn_output(1)  # header (layer 0, stage 1) is now remembered as valid
    ffn.send_ffn_output(got.hidden_states, got.metadata)
    attn.recv_ffn_output(x, 1)
    # the very same bytes arriving on stage 0's socket are still caught
    forged = encode_header(_header(0, stage=1))
    attn._data[0].sock.send_multipart([forged, x.numpy().tobytes()])
    with pytest.raises(WireFormatError, match="stage 1 arrived on the socket of stage 0"):
        ffn.recv_attn_output(0)
    # a header with the wrong tensor names never becomes valid
    bad = TensorHeader("a2f", 0, 0, (2,), (TensorSpec("hidden", "float32", (2, HIDDEN)),))
    for _ in range(2):
        attn._data[0].sock.send_multipart([encode_header(bad), x.numpy().tobytes()])
        with pytest.raises(WireFormatError, match=r"a2f message from a0: tensors \['hidden'\]"):
            ffn.recv_attn_output(0)
    # the connector drained each rejected message: the next good one arrives whole
    attn.send_attn_output(x, TransferMetadata(1, 0, (2,)))
    assert torch.equal(ffn.recv_attn_output(0).hidden_states, x)


def test_ffn_rejects_a_message_whose_tensor_frames_the_header_does_not_announce(pair):
    attn, ffn = pair
    x = torch.randn(2, HIDDEN)
    header = encode_header(_header(0))
    attn._data[0].sock.send_multipart([header])  # no tensor frame
    with pytest.raises(WireFormatError, match=r"a2f message from a0: 0 tensor frame\(s\); the header announced 1"):
        ffn.recv_attn_output(0)
    attn._data[0].sock.send_multipart([header, x.numpy().tobytes()[:-4]])  # one element short
    with pytest.raises(WireFormatError, match="has 124 bytes; the header announced 128"):
        ffn.recv_attn_output(0)
    attn.send_attn_output(x, TransferMetadata(0, 0, (2,)))
    assert torch.equal(ffn.recv_attn_output(0).hidden_states, x)


@pytest.mark.skipif(len(WIRES) < 2, reason=f"the native wire cannot run here: {native_wire_problem()}")
@pytest.mark.parametrize(("attn_wire", "ffn_wire"), [("native", "pyzmq"), ("pyzmq", "native")])
@pytest.mark.parametrize("rows", [0, 2, 4096])  # empty, copied, zero-copy (256 KiB) parts
def test_native_and_pyzmq_wires_interoperate_value_exact(attn_wire, ffn_wire, rows):
    attn, ffn = _live_pair(attn_wire, ffn_wire)
    try:
        announce_step(attn, ControlPayload(0, ((rows,), (rows,)), 2, 8))
        cp = ffn.require_control_plane()
        cp.apply(cp.recv(timeout_s=5))
        for layer in range(3):
            x = torch.randn(rows, HIDDEN)
            attn.send_attn_output(x, TransferMetadata(layer, 0, (rows,)))
            got = ffn.recv_attn_output(0)
            assert torch.equal(got.hidden_states, x)
            ffn.send_ffn_output(got.hidden_states + 1, got.metadata)
            assert torch.equal(attn.recv_ffn_output(x, 0), x + 1)
    finally:
        attn.close()
        ffn.close()


@pytest.mark.skipif(len(WIRES) < 2, reason=f"the native wire cannot run here: {native_wire_problem()}")
def test_native_wire_keeps_a_zero_copy_tensor_alive_until_libzmq_releases_it():
    import gc
    import time
    import weakref

    from afd_connectors.zmq import _zmqwire

    attn, ffn = _live_pair("native", "native")
    try:
        announce_step(attn, ControlPayload(0, ((8192,), (8192,)), 2, 8))
        cp = ffn.require_control_plane()
        cp.apply(cp.recv(timeout_s=5))
        x = torch.randn(8192, HIDDEN)  # 512 KiB: zero-copy
        expected = x.clone()
        ref = weakref.ref(x)
        attn.send_attn_output(x, TransferMetadata(0, 0, (8192,)))
        del x
        gc.collect()
        got = ffn.recv_attn_output(0)  # the bytes arrive whole although the caller dropped its tensor
        assert torch.equal(got.hidden_states, expected)
        deadline = time.monotonic() + 5
        while _zmqwire.pending() and time.monotonic() < deadline:  # libzmq frees on its I/O thread
            time.sleep(0.01)
        assert _zmqwire.pending() == 0 and ref() is None  # and the wire let go of it
    finally:
        attn.close()
        ffn.close()


def test_wire_native_is_refused_at_validation_where_it_cannot_run(monkeypatch):
    from afd_connectors.zmq import connector as zmq_connector
    from afd_sdk.config import parse_config
    from afd_sdk.errors import AFDConfigError
    from afd_sdk.plugins import get_plugin_manager

    monkeypatch.setattr(zmq_connector, "native_wire_problem", lambda: "afd_connectors.zmq._zmqwire does not import (x)")
    cfg = parse_config({"connector": "zmq", "role": "ffn", "connector_extra_config": {"wire": "native"}})
    with pytest.raises(AFDConfigError, match=r"wire='native' cannot run here \(afd_connectors.zmq._zmqwire does not"):
        get_plugin_manager().resolve_config(cfg)
    auto = parse_config({"connector": "zmq", "role": "ffn", "connector_extra_config": {"wire": "auto"}})
    get_plugin_manager().resolve_config(auto)  # auto falls back to pyzmq instead


def _round_trip(attn, ffn, x: torch.Tensor, layer: int, stage: int = 0) -> None:
    attn.send_attn_output(x, TransferMetadata(layer, stage, (x.shape[0],)))
    got = ffn.recv_attn_output(stage)
    ffn.send_ffn_output(got.hidden_states + 1, got.metadata)
    assert torch.equal(attn.recv_ffn_output(x, stage), x + 1)


@pytest.mark.parametrize("rows", [2, 4096])  # copied into the receive areas, and zero-copy (256 KiB)
def test_memoised_checks_still_refuse_what_the_first_call_refused(pair, rows):
    """The steady state skips checks for a (metadata, shape, dtype) that passed them: every error stays."""
    attn, ffn = pair
    x = torch.randn(rows, HIDDEN)
    for layer in range(2):  # twice per key: the second time through the memoised path
        _round_trip(attn, ffn, x, layer % 1)
    # the steady state is cached: in C++ where it is built (native wire), else in Python
    assert ffn._a2f_known and (attn._steady is not None or (attn._send_plans and ffn._f2a_plans))
    md = TransferMetadata(0, 0, (rows,))
    with pytest.raises(ConnectorError, match="without a preceding send_attn_output"):
        attn.recv_ffn_output(x, 0)
    with pytest.raises(ConnectorError, match=rf"hidden_states \[{rows}, 17\]"):
        attn.send_attn_output(torch.randn(rows, HIDDEN + 1), md)
    with pytest.raises(ConnectorError, match="seq_lens="):
        attn.send_attn_output(x, TransferMetadata(0, 0, (rows + 1,)))
    with pytest.raises(ConnectorError, match="send_ffn_output\\(\\) is a ffn-side call"):
        attn.send_ffn_output(x, md)
    with pytest.raises(ConnectorError, match="send_attn_output\\(\\) is a attention-side call"):
        ffn.send_attn_output(x, md)
    with pytest.raises(ConnectorError, match="recv_ffn_output\\(\\) is a attention-side call"):
        ffn.recv_ffn_output(x, 0)
    attn.send_attn_output(x, md)
    with pytest.raises(ConnectorError, match="stage 0 already has a send awaiting"):
        attn.send_attn_output(x, md)  # the same key as a cached plan, while its send is pending
    got = ffn.recv_attn_output(0)
    with pytest.raises(ConnectorError, match="ffn output shape"):
        ffn.send_ffn_output(torch.randn(rows + 1, HIDDEN), got.metadata)
    ffn.send_ffn_output(got.hidden_states, got.metadata)
    assert torch.equal(attn.recv_ffn_output(x, 0), x)


@pytest.mark.parametrize("rows", [2, 4096])
def test_ffn_steady_state_still_checks_sender_frame_count_and_sizes(pair, rows):
    """A header byte-equal to an accepted one skips its checks; the sender and the frames are checked each time."""
    import zmq

    attn, ffn = pair
    x = torch.randn(rows, HIDDEN)
    _round_trip(attn, ffn, x, 0)
    header = encode_header(_header(0, n=rows))
    assert (0, header) in ffn._a2f_known
    data = x.numpy().tobytes()
    sock = attn._data[0].sock
    sock.send_multipart([header, data, data])  # one frame more than announced
    with pytest.raises(WireFormatError, match="2 tensor frame\\(s\\); the header announced 1"):
        ffn.recv_attn_output(0)
    sock.send_multipart([header, data[:-4]])  # one element short
    with pytest.raises(WireFormatError, match=f"has {len(data) - 4} bytes; the header announced {len(data)}"):
        ffn.recv_attn_output(0)
    ctx = zmq.Context.instance()
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.ROUTING_ID, b"a7")
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(ffn.data_address(0, 0))
    try:
        stranger.send_multipart([header, data])
        with pytest.raises(WireFormatError, match="a2f message from a7: unknown sender"):
            ffn.recv_attn_output(0)
    finally:
        stranger.close()
    _round_trip(attn, ffn, x, 0)  # and the steady state goes on


@pytest.mark.parametrize("rows", [2, 4096])  # copied into the receive area, and zero-copy (256 KiB)
def test_attention_steady_state_still_checks_the_output_frame_size(pair, rows):
    """The expected f2a header skips its checks; the frame's size is checked each time, in both receive paths."""
    attn, ffn = pair
    x = torch.randn(rows, HIDDEN)
    _round_trip(attn, ffn, x, 0)
    _round_trip(attn, ffn, x, 0)  # the f2a plan for (layer 0, stage 0, rows) exists now
    header = encode_header(_header(0, n=rows, kind="f2a"))
    data = x.numpy().tobytes()
    for frame in (data[:-4], data + bytes(4)):  # one element short, one too many
        attn.send_attn_output(x, TransferMetadata(0, 0, (rows,)))
        ffn.recv_attn_output(0)
        _forge_f2a(ffn, [header, frame])
        with pytest.raises(WireFormatError, match=f"has {len(frame)} bytes; the header announced {len(data)}"):
            attn.recv_ffn_output(x, 0)
    _round_trip(attn, ffn, x, 0)  # and the steady state goes on


def test_a_message_that_ends_before_its_tensor_frame_is_refused_and_the_next_one_served(pair):
    """A header alone, or an unknown sender's identity alone: the receive reads that message and nothing of the
    next one (which the steady state must then serve)."""
    attn, ffn = pair
    x = torch.randn(2, HIDDEN)
    _round_trip(attn, ffn, x, 0)
    _round_trip(attn, ffn, x, 0)
    attn.send_attn_output(x, TransferMetadata(0, 0, (2,)))
    ffn.recv_attn_output(0)
    _forge_f2a(ffn, [encode_header(_header(0, kind="f2a"))])  # the expected header, no frame after it
    with pytest.raises(WireFormatError, match=r"1 tensor header\(s\) and 0 tensor frame\(s\)"):
        attn.recv_ffn_output(x, 0)
    attn._data[0].sock.send_multipart([encode_header(_header(0))])  # an a2f header alone
    with pytest.raises(WireFormatError, match=r"0 tensor frame\(s\); the header announced 1"):
        ffn.recv_attn_output(0)
    _round_trip(attn, ffn, x, 0)


def test_memoised_plans_are_dropped_at_close(pair):
    attn, ffn = pair
    x = torch.randn(2, HIDDEN)
    _round_trip(attn, ffn, x, 0)
    attn.close()
    ffn.close()
    assert not (attn._send_plans or ffn._f2a_plans or ffn._a2f_known or ffn._a2f_fast)
    assert attn._steady is None and ffn._steady is None
    with pytest.raises(ConnectorError, match="init"):
        attn.send_attn_output(x, TransferMetadata(0, 0, (2,)))
    with pytest.raises(ConnectorError, match="init"):
        ffn.recv_attn_output(0)


@pytest.mark.parametrize("rows", [2, 4096])  # copied into the receive areas, and zero-copy (256 KiB)
def test_the_steady_state_runs_no_python_check_where_it_is_built(pair, rows, monkeypatch):
    """After one round trip per key, the C++ steady state serves all four calls: the Python path (its checks,
    its receive loop) runs on neither side. Without it, that path runs every call: so the count tells which."""
    attn, ffn = pair
    x = torch.randn(rows, HIDDEN)
    for layer in range(3):
        _round_trip(attn, ffn, x, layer)
    calls = []
    for conn in (attn, ffn):
        for name in ("require_role", "_recv_message", "_f2a_output", "_one_peer_payload"):
            real = getattr(conn, name)
            monkeypatch.setattr(
                conn, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
            )
    kept = []  # zero-copy outputs own their frames: each keeps its value while later ones arrive
    for step in range(4):
        for layer in range(3):
            y = torch.randn(rows, HIDDEN)
            attn.send_attn_output(y, TransferMetadata(layer, 0, (rows,)))
            got = ffn.recv_attn_output(0)
            assert torch.equal(got.hidden_states, y) and got.metadata == TransferMetadata(layer, 0, (rows,))
            ffn.send_ffn_output(got.hidden_states * step, got.metadata)
            out = attn.recv_ffn_output(y, 0)
            assert torch.equal(out, y * step)
            if rows > 2:
                kept.append((out, (y * step).clone()))
    assert all(torch.equal(out, want) for out, want in kept)
    if attn._steady is not None:
        assert calls == []
    else:  # the Python steady state receives through its loop on both sides, every call
        assert calls.count("_recv_message") == 2 * 4 * 3
