"""ShmAFDConnector specifics: nothing is left in /dev/shm, after close and after a crash of either side."""

import os
import time

import pytest
import torch

from afd_sdk.config import parse_config
from afd_sdk.errors import AFDConfigError
from afd_sdk.plugins import get_plugin_manager
from afd_sdk.runtime.world import run_world
from afd_sdk.testing import ConnectorConformance

pytestmark = pytest.mark.multiprocess


def leftovers(port: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"afd-{port}-")]


class _Spec(ConnectorConformance):
    connector = "shm"


@pytest.mark.parametrize("victim", [None, "ffn", "attention"])
def test_no_segments_left_behind(victim):
    spec = _Spec().make_spec("roundtrip", attention=2, stages=2, layers=3, timeout_s=5.0)
    if victim:
        spec["die"] = {"role": victim, "at_layer": 1}
    world = run_world(spec, module="afd_sdk.testing.worker", timeout_s=120)
    if victim is None:
        assert all(r.ok for r in world.ranks), world.describe()
    else:
        survivors = [r for r in world.ranks if r.role != victim]
        assert any(r.error_type == "PeerLostError" for r in survivors), world.describe()
    assert leftovers(spec["afd"]["port"]) == []


def test_rejects_non_loopback_host():
    cfg = parse_config({"role": "ffn", "connector": "shm", "host": "10.1.2.3"})
    with pytest.raises(AFDConfigError, match="same host only"):
        get_plugin_manager().resolve_config(cfg)


def test_rejects_an_ffn_pool_across_hosts():
    cfg = parse_config(
        {
            "role": "ffn",
            "connector": "shm",
            "num_attention_ranks": 2,
            "num_ffn_ranks": 2,
            "ffn_hosts": "127.0.0.1,10.1.2.3",
        }
    )
    with pytest.raises(AFDConfigError, match=r"afd.ffn_hosts\[1\]='10.1.2.3' .*same host only") as info:
        get_plugin_manager().resolve_config(cfg)
    assert info.value.key == "afd.ffn_hosts[1]"


EXTRAS = [
    {"name": "input_ids", "dtype": "int32"},
    {"name": "topk_weights", "dtype": "float32", "trailing_shape": [2]},
]


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize(("attention", "ffn", "dtype"), [(1, 1, "bfloat16"), (3, 2, "float16")])
def test_round_trips_with_extras_in_both_receive_modes(in_place, attention, ffn, dtype):
    """Single peer (in-place views or one copy) and fan-in (copies into the concatenated buffer), with
    extras, a 2-byte dtype, two stages and a zero-token stage; the conformance suite runs the default mode."""
    spec = _Spec().make_spec(
        "roundtrip", attention=attention, ffn=ffn, stages=2, dtype=dtype, extras=EXTRAS, tokens=[5, 0, 3, 1]
    )
    spec["afd"]["connector_extra_config"]["in_place"] = in_place
    world = run_world(spec, module="afd_sdk.testing.worker", timeout_s=120)
    assert all(r.ok and r.result.get("checks", 0) > 0 for r in world.ranks), world.describe()
    assert leftovers(spec["afd"]["port"]) == []


@pytest.mark.parametrize(("attention", "slots", "in_place"), [(1, 1, False), (2, 1, False), (2, 2, True)])
def test_smallest_rings_do_not_deadlock(attention, slots, in_place):
    """Two stages in flight on the fewest slots each mode allows (an in-place view holds its slot)."""
    spec = _Spec().make_spec("roundtrip", attention=attention, stages=2, layers=3, timeout_s=5.0)
    spec["afd"]["connector_extra_config"].update({"slots": slots, "in_place": in_place})
    world = run_world(spec, module="afd_sdk.testing.worker", timeout_s=120)
    assert all(r.ok for r in world.ranks), world.describe()
    assert leftovers(spec["afd"]["port"]) == []


def test_in_place_needs_two_slots():
    cfg = parse_config({"role": "ffn", "connector": "shm", "connector_extra_config": {"slots": 1}})
    with pytest.raises(AFDConfigError, match="slots=1 is invalid with in_place=true") as info:
        get_plugin_manager().resolve_config(cfg)
    assert info.value.key == "afd.connector_extra_config.slots"


def test_missing_native_module_is_a_config_error(monkeypatch):
    from afd_connectors.shm import connector as shm_connector

    monkeypatch.setattr(shm_connector, "_NATIVE_MISSING", "No module named 'afd_connectors.shm._shmring'")
    cfg = parse_config({"role": "ffn", "connector": "shm", "host": "127.0.0.1"})
    with pytest.raises(AFDConfigError, match="_shmring") as info:
        get_plugin_manager().resolve_config(cfg)
    assert info.value.key == "afd.connector"


# --- one process, both sides: the ring's bookkeeping without a control plane ------------------


@pytest.fixture(params=["steady", "python"])
def steady(request) -> bool:
    """Each one-process test runs over the C++ steady state (afd_connectors.shm._shmsteady) and without it."""
    if request.param == "steady":
        from afd_connectors.shm import connector as shm

        if shm._shmsteady is None:
            pytest.skip(
                "afd_connectors.shm._shmsteady is not built here (a build without torch; scripts/test.sh "
                "requires it in .venv)"
            )
    return request.param == "steady"


def _pair(tmp_path, *, in_place: bool, slots: int = 2, steady: bool):
    """An attention and an FFN connector over one segment, wired by hand (no processes, no ZMQ), each with its C++
    steady state as open() makes it, or (``steady=False``) without one."""
    from afd_connectors.shm import connector as shm
    from afd_sdk.runtime.session import connector_from_spec as build_connector

    spec = {
        "role": "attention",
        "rank": 0,
        "afd": {
            "connector": "shm",
            "host": "127.0.0.1",
            "port": 1,
            "timeout_s": 0.2,
            "connector_extra_config": {"in_place": in_place, "slots": slots, "shm_dir": str(tmp_path)},
        },
        "model": {"architecture": "Pair", "hidden_size": 8, "dtype": "float32", "num_layers": 2},
        "max_num_tokens": 4,
    }
    att = build_connector(spec)
    ffn = build_connector({**spec, "role": "ffn"})
    path = str(tmp_path / "seg")
    ch_f = shm._Channel(path, att._segment_size(), True, slots, att._slot_size, att._slot_data, 0)
    ch_a = shm._Channel(path, att._segment_size(), False, slots, att._slot_size, att._slot_data, 0)
    for conn, ch in ((att, ch_a), (ffn, ch_f)):
        conn._stage_rings = [[ch]]
        conn._peers = (0,)
        conn._initialized = True
        conn._steady = conn._make_steady() if steady else None
        assert (conn._steady is not None) is steady
    return att, ffn


def _close(*conns):
    for c in conns:
        for (ch,) in c._stage_rings:
            ch.close()


@pytest.mark.parametrize("in_place", [True, False])
def test_received_tensors_live_until_the_next_receive(tmp_path, in_place, steady):
    from afd_sdk.wire import TransferMetadata

    att, ffn = _pair(tmp_path, in_place=in_place, steady=steady)
    try:

        def in_segment(conn, t):
            seg = conn._stage_rings[0][0].segment
            return seg.data_ptr() <= t.data_ptr() < seg.data_ptr() + seg.numel()

        x = torch.arange(24, dtype=torch.float32).view(3, 8)
        att.send_attn_output(x, TransferMetadata(0, 0, (3,)))
        got = ffn.recv_attn_output(0)
        assert torch.equal(got.hidden_states, x)
        assert in_segment(ffn, got.hidden_states) is in_place  # a view of the slot, or a copy
        ffn.send_ffn_output(got.hidden_states * 2, got.metadata)
        out = att.recv_ffn_output(x, 0)
        assert torch.equal(out, x * 2)
        assert in_segment(att, out) is in_place
        # the next layer goes to the other slot: both received tensors are still intact before the next receive
        att.send_attn_output(x + 1, TransferMetadata(1, 0, (3,)))
        assert torch.equal(got.hidden_states, x) and torch.equal(out, x * 2)
        nxt = ffn.recv_attn_output(0)
        assert nxt.metadata.layer_idx == 1 and torch.equal(nxt.hidden_states, x + 1)
    finally:
        _close(att, ffn)


def test_torn_slot_is_a_wire_format_error(tmp_path, steady):
    import struct

    from afd_sdk.errors import WireFormatError
    from afd_sdk.wire import TransferMetadata

    att, ffn = _pair(tmp_path, in_place=True, steady=steady)
    try:
        att.send_attn_output(torch.ones(2, 8), TransferMetadata(0, 0, (2,)))
        ch = ffn._stage_rings[0][0]
        struct.pack_into("<Q", ch.mm, ch.a2f.slots_at, 5)  # the slot claims another sequence number
        with pytest.raises(WireFormatError, match="seq=5.*expected seq=1"):
            ffn.recv_attn_output(0)
    finally:
        _close(att, ffn)


def test_oversized_payload_and_non_cpu_dtype_are_rejected_before_writing(tmp_path, steady):
    from afd_sdk.errors import ConnectorError
    from afd_sdk.wire import TransferMetadata

    att, ffn = _pair(tmp_path, in_place=True, steady=steady)
    try:
        ring = att._stage_rings[0][0].a2f
        with pytest.raises(ConnectorError, match="exceeds the shared-memory slot"):
            att.send_attn_output(torch.ones(400, 8), TransferMetadata(0, 0, (400,)))
        with pytest.raises(ConnectorError, match="carries CPU tensors of"):
            att.send_attn_output(torch.ones(2, 8, dtype=torch.complex64), TransferMetadata(0, 0, (2,)))
        assert ring.next_seq == 1  # nothing was published
    finally:
        _close(att, ffn)


def test_full_ring_writer_gives_up_within_timeout(tmp_path, steady):
    """The reader never frees its slot: the writer's wait ends in PeerLostError after timeout_s."""
    from afd_sdk.errors import PeerLostError
    from afd_sdk.wire import TransferMetadata

    att, ffn = _pair(tmp_path, in_place=False, slots=1, steady=steady)
    try:
        ch = ffn._stage_rings[0][0]
        att.send_attn_output(torch.ones(1, 8), TransferMetadata(0, 0, (1,)))
        att.sends.clear()  # pretend the output came back: a second send needs the only slot
        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match="a free slot"):
            att.send_attn_output(torch.ones(1, 8), TransferMetadata(1, 0, (1,)))
        assert time.monotonic() - t0 < 5
        assert ch.a2f.next_seq == 1
    finally:
        _close(att, ffn)


@pytest.mark.parametrize("in_place", [True, False])
def test_the_steady_state_runs_no_python_check_where_it_is_built(tmp_path, in_place, steady, monkeypatch):
    """After one round trip per (slot, layer, tokens, dtype), the C++ steady state serves all four calls: none of
    the Python path's checks or ring calls runs on either side. Without it, they run every call: so the count
    tells which path served, and the values tell that it served them right."""
    from afd_sdk.wire import TransferMetadata

    att, ffn = _pair(tmp_path, in_place=in_place, steady=steady)
    try:
        for layer in range(2):  # two slots: each (slot, layer) key once
            x = torch.randn(3, 8)
            att.send_attn_output(x, TransferMetadata(layer, 0, (3,)))
            ffn.send_ffn_output(ffn.recv_attn_output(0).hidden_states, TransferMetadata(layer, 0, (3,)))
            att.recv_ffn_output(x, 0)
        calls: list[str] = []
        for conn in (att, ffn):
            for name in ("require_role", "check_stage", "check_attn_send", "check_ffn_send", "_write", "_await"):
                real = getattr(conn, name)
                monkeypatch.setattr(
                    conn, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
                )
        for step in range(3):
            for layer in range(2):
                x = torch.randn(3, 8)
                att.send_attn_output(x, TransferMetadata(layer, 0, (3,)))
                got = ffn.recv_attn_output(0)
                assert torch.equal(got.hidden_states, x) and got.metadata == TransferMetadata(layer, 0, (3,))
                ffn.send_ffn_output(got.hidden_states * step, got.metadata)
                assert torch.equal(att.recv_ffn_output(x, 0), x * step)
        if steady:
            assert calls == []
        else:
            assert calls.count("_write") == calls.count("_await") == 2 * 3 * 2
    finally:
        _close(att, ffn)


def test_what_the_steady_state_declines_the_python_path_reports(tmp_path, steady):
    """Calls the C++ steady state must not serve end in the Python path's errors, with the ring unchanged."""
    from afd_sdk.errors import ConnectorError
    from afd_sdk.wire import TransferMetadata

    att, ffn = _pair(tmp_path, in_place=True, steady=steady)
    try:
        x = torch.randn(2, 8)
        for layer in range(2):  # every key planned, so the steady state would serve a well-formed call
            att.send_attn_output(x, TransferMetadata(layer, 0, (2,)))
            ffn.send_ffn_output(ffn.recv_attn_output(0).hidden_states, TransferMetadata(layer, 0, (2,)))
            att.recv_ffn_output(x, 0)
        with pytest.raises(ConnectorError, match="without a preceding send_attn_output"):
            att.recv_ffn_output(x, 0)
        with pytest.raises(ConnectorError, match="expected"):
            att.send_attn_output(x, TransferMetadata(0, 0, (3,)))  # seq_lens disagree with the tensor
        with pytest.raises(ConnectorError, match="out of range"):
            att.send_attn_output(x, TransferMetadata(0, 1, (2,)))
        with pytest.raises(ConnectorError, match="attention"):
            ffn.send_attn_output(x, TransferMetadata(0, 0, (2,)))  # the wrong role
        att.send_attn_output(
            x.t().contiguous().t(), TransferMetadata(0, 0, (2,))
        )  # not contiguous: served after a copy
        with pytest.raises(ConnectorError, match="already has a send awaiting"):
            att.send_attn_output(x, TransferMetadata(0, 0, (2,)))
        got = ffn.recv_attn_output(0)
        assert torch.equal(got.hidden_states, x)
        ffn.send_ffn_output(got.hidden_states, TransferMetadata(1, 0, (2,)))  # answers the wrong layer
        with pytest.raises(ConnectorError, match="for layer 1; expected 2 tokens for layer 0"):
            att.recv_ffn_output(x, 0)
    finally:
        _close(att, ffn)


def test_raw_ring_runs_the_connector_geometry_it_is_given(tmp_path):
    """``afd bench``'s raw shm baseline takes the connector's extra config: its rings have the same slots, and
    each message lands in slot ``(seq - 1) % slots``, as in the connector."""
    import struct
    import threading

    from afd_connectors.shm.raw import RawShm
    from afd_connectors.shm.spin import default_spin_max_us

    port = 40000 + os.getpid() % 20000
    ffn = RawShm(
        "ffn",
        host="127.0.0.1",
        port=port,
        max_bytes=4096,
        timeout_s=5.0,
        extra={"slots": 3, "spin_us": 5, "spin_max_us": 50},
    )
    att = RawShm("attention", host="127.0.0.1", port=port, max_bytes=4096, timeout_s=5.0, extra={"slots": 3})
    try:
        assert (ffn.slots, ffn.spin.base_us, ffn.spin.max_us) == (3, 5.0, 50.0)
        # the connector's defaults: an unset spin_max_us adapts up to 1000 µs only with cores to spare
        assert (att.slots, att.spin.base_us, att.spin.max_us) == (3, 100.0, default_spin_max_us(100.0))
        assert len(ffn.mm) == 512 + 2 * 3 * (64 + 4096)
        echo = threading.Thread(target=ffn.ffn_echo, args=(7, 4096))
        echo.start()
        rt = att.attention_round_trip(torch.arange(1024, dtype=torch.float32))
        for _ in range(7):
            rt()
        echo.join(10)
        assert not echo.is_alive()
        for ring in (att.a2f, att.f2a):
            seqs = [struct.unpack_from("<Q", att.mm, att._slot(ring, s) - att.a2f[0])[0] for s in (5, 6, 7)]
            assert seqs == [5, 6, 7]  # the last three messages, one per slot
        data = att.seg[att._slot(att.f2a, 7) - att.a2f[0] + 64 :][:4096].view(torch.float32)
        assert torch.equal(data, torch.arange(1024, dtype=torch.float32))  # echoed through slot 0 of each ring
    finally:
        att.close()
        ffn.close()
    assert not os.path.exists(f"/dev/shm/afd-bench-{port}")


def test_the_attention_side_maps_the_rings_the_ffn_side_made():
    """The FFN sizes the slots for its max_num_tokens and the attention side for its own (vLLM engines take
    theirs from max_num_batched_tokens): the attention side maps the rings where the FFN put them."""
    spec = _Spec().make_spec("roundtrip", attention=2, stages=2, layers=3, tokens=[5, 0, 3, 1])
    spec["max_num_tokens"] = {"attention": 8, "ffn": 4096}
    world = run_world(spec, module="afd_sdk.testing.worker", timeout_s=120)
    assert all(r.ok and r.result.get("checks", 0) > 0 for r in world.ranks), world.describe()
    assert leftovers(spec["afd"]["port"]) == []


def test_an_ffn_side_sized_for_fewer_tokens_is_refused_at_open():
    spec = _Spec().make_spec("roundtrip", attention=1, stages=1, layers=2, timeout_s=5.0)
    spec["max_num_tokens"] = {"attention": 4096, "ffn": 8}
    world = run_world(spec, module="afd_sdk.testing.worker", timeout_s=120)
    (attn,) = [r for r in world.ranks if r.role == "attention"]
    assert not attn.ok and attn.error_type == "ConnectorError", world.describe()
    message = attn.result["error_message"]
    assert "the FFN rank made slots of" in message and "max_num_batched_tokens" in message, message
    assert leftovers(spec["afd"]["port"]) == []
