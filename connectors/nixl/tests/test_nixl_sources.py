"""Where a NIXL write starts from: in place from registered memory, or from a staging copy, values exact either way.

A storage sent from a second time while alive is registered and written from
in place; a fresh tensor is copied into the registered staging region (or,
from ``DIRECT_MIN_BYTES``, registered for that one write); the FFN's output
that lies in its receive region is written from there. These tests run one
FFN and one attention connector in one process, the FFN side in a thread.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import afd_connector_nixl.agent as agent_module
from afd_connector_nixl.connector import DIRECT_MIN_BYTES
from afd_sdk.runtime.attention_runner import announce_step
from afd_sdk.runtime.session import connector_from_spec
from afd_sdk.runtime.world import free_port_block
from afd_sdk.testing import init_in_threads
from afd_sdk.wire import ControlPayload, TransferMetadata

HIDDEN = 1024
MAX_TOKENS = DIRECT_MIN_BYTES // (HIDDEN * 4)  # fp32: the largest exchange is one direct-size write


def _pair(extra: dict[str, Any] | None = None) -> tuple[Any, Any]:
    port = free_port_block(16)
    spec = {
        "afd": {"connector": "nixl", "port": port, "timeout_s": 10, "connector_extra_config": extra or {}},
        "model": {"architecture": "T", "hidden_size": HIDDEN, "dtype": "float32", "num_layers": 4},
        "max_num_tokens": MAX_TOKENS,
    }
    ffn = connector_from_spec({**spec, "role": "ffn", "rank": 0})
    attn = connector_from_spec({**spec, "role": "attention", "rank": 0})
    init_in_threads(ffn, [attn])
    announce_step(attn, ControlPayload(0, ((0,),), MAX_TOKENS, 1))  # token counts change below: no announced count
    cp = ffn.require_control_plane()
    cp.recv(timeout_s=10)  # read and leave unapplied: the FFN checks no announced count
    return ffn, attn


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any]]:
    ffn, attn = _pair()
    yield ffn, attn
    attn.close()
    ffn.close()


def _exchange(
    ffn: Any, attn: Any, x: torch.Tensor, layer: int, ffn_fn: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer: ``x`` to the FFN, ``ffn_fn`` of what arrived back; (what the FFN received, what came back)."""
    got: list[Any] = []

    def serve() -> None:
        try:
            payload = ffn.recv_attn_output(0)
            got.append(payload.hidden_states.clone())
            ffn.send_ffn_output(ffn_fn(payload.hidden_states), payload.metadata)
        except BaseException as exc:  # re-raised below, in the test's thread
            got.append(exc)

    server = threading.Thread(target=serve)
    server.start()
    attn.send_attn_output(x, TransferMetadata(layer, 0, (x.shape[0],)))
    out = attn.recv_ffn_output(x, 0).clone()
    server.join(10)
    if isinstance(got[-1], BaseException):
        raise got[-1]
    return got[0], out


def _count_calls(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str) -> list[int]:
    """Count calls of ``obj.name`` (still calling it)."""
    calls: list[int] = []
    real = getattr(obj, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, spy)
    return calls


def _foreign_sources(conn: Any) -> list[Any]:
    return [s for s in conn._agent._sources.values() if not s.own]


def test_a_static_buffer_is_registered_at_its_second_send_and_written_in_place(pair, monkeypatch):
    ffn, attn = pair
    copies = _count_calls(monkeypatch, attn, "_stage_copy")
    buf = torch.empty(4, HIDDEN)
    for layer in range(4):
        buf.copy_(torch.randn(4, HIDDEN))  # a static buffer: new contents, same memory
        received, out = _exchange(ffn, attn, buf, layer, lambda h: h * 2)
        assert torch.equal(received, buf) and torch.equal(out, buf * 2), layer
    assert len(copies) == 1  # the first send was staged; from the second on the buffer is a source
    [source] = _foreign_sources(attn)
    assert source.region.addr == buf.untyped_storage().data_ptr()


def test_a_non_contiguous_tensor_of_a_known_shape_is_sent_by_value(pair):
    ffn, attn = pair
    x = torch.randn(3, HIDDEN)
    _exchange(ffn, attn, x, 0, lambda h: h + 1)  # the shape's plan exists from here on
    y = torch.randn(HIDDEN, 3).t()  # [3, HIDDEN], not contiguous: a memmove from its address would be wrong
    assert not y.is_contiguous()
    received, out = _exchange(ffn, attn, y, 0, lambda h: h + 1)
    assert torch.equal(received, y) and torch.equal(out, y + 1)


def test_fresh_tensors_are_staged_and_never_registered(pair, monkeypatch):
    ffn, attn = pair
    copies = _count_calls(monkeypatch, attn, "_stage_copy")
    for layer, n in enumerate([1, 5, 5, 2, 5]):
        x = torch.randn(n, HIDDEN)
        received, out = _exchange(ffn, attn, x, layer % 4, lambda h: h - 1)
        assert torch.equal(received, x) and torch.equal(out, x - 1), layer
        del x, received, out
    assert len(copies) == 5
    assert _foreign_sources(attn) == []


def test_a_dead_source_is_deregistered_before_its_memory_is_sent_from_again(pair):
    ffn, attn = pair
    agent = attn._agent
    buf = torch.randn(6, HIDDEN)
    for layer in range(3):
        _exchange(ffn, attn, buf, layer, lambda h: h * 3)
    [source] = _foreign_sources(attn)
    lo, hi = source.region.addr, source.region.addr + source.region.nbytes
    assert any(lo <= addr < hi for key in agent._writes for addr, _, _ in key[1])  # a request reads from it
    generation = agent.generation
    del buf, source
    gc.collect()
    # the next tensor of that size: the allocator typically hands the same address back
    x = torch.randn(6, HIDDEN)
    received, out = _exchange(ffn, attn, x, 3, lambda h: h * 3)
    assert torch.equal(received, x) and torch.equal(out, x * 3)
    assert agent.generation == generation + 1
    assert _foreign_sources(attn) == []  # x was seen once: staged, not registered
    assert not any(
        lo <= addr < hi
        and not any(s.region.addr <= addr < s.region.addr + s.region.nbytes for s in agent._sources.values())
        for key in agent._writes
        for addr, _, _ in key[1]
    )


def test_ffn_output_in_its_receive_region_is_written_in_place_and_a_fresh_one_is_staged(pair, monkeypatch):
    ffn, attn = pair
    copies = _count_calls(monkeypatch, ffn, "_stage_copy")
    x = torch.randn(4, HIDDEN)
    _, out = _exchange(ffn, attn, x, 0, lambda h: h.mul_(3))  # in place: the output is the receive region
    assert torch.equal(out, x * 3) and copies == []
    _, out = _exchange(ffn, attn, x, 1, lambda h: h * 5)  # a fresh tensor: one staging copy
    assert torch.equal(out, x * 5) and len(copies) == 1


def test_a_large_fresh_tensor_is_registered_for_one_write_only(pair, monkeypatch):
    ffn, attn = pair
    direct = _count_calls(monkeypatch, attn._agent, "write_from")
    registered = len(attn._agent._registered)
    for layer in range(2):
        x = torch.randn(MAX_TOKENS, HIDDEN)  # DIRECT_MIN_BYTES exactly
        received, out = _exchange(ffn, attn, x, layer, lambda h: h + 2)
        assert torch.equal(received, x) and torch.equal(out, x + 2)
        del x, received, out
    assert len(direct) == 2
    assert len(attn._agent._registered) == registered  # each write's registration was released


def test_register_sources_off_stages_every_send():
    ffn, attn = _pair({"register_sources": False})
    try:
        copies = []
        real = attn._stage_copy
        attn._stage_copy = lambda *a: (copies.append(1), real(*a))
        buf = torch.randn(4, HIDDEN)
        for layer in range(3):
            received, out = _exchange(ffn, attn, buf, layer, lambda h: h * 2)
            assert torch.equal(received, buf) and torch.equal(out, buf * 2)
        assert len(copies) == 3
        assert _foreign_sources(attn) == []
    finally:
        attn.close()
        ffn.close()


def test_the_request_cache_stays_bounded_and_never_evicts_a_busy_request(pair, monkeypatch):
    ffn, attn = pair
    monkeypatch.setattr(agent_module, "MAX_CACHED_WRITES", 4)
    for layer, n in enumerate(range(1, 11)):  # ten token counts: ten distinct requests per side
        x = torch.randn(n, HIDDEN)
        _, out = _exchange(ffn, attn, x, layer % 4, lambda h: h * 2)
        assert torch.equal(out, x * 2), n
    for conn in (attn, ffn):
        assert len(conn._agent._writes) <= 4
    # a request posted and not yet seen finished survives eviction
    agent = attn._agent
    busy_key, busy = next(iter(agent._writes.items()))
    agent._busy.add(busy)
    remote = attn._remote[0]["a2f/0"]
    try:
        with agent.lock:
            for i in range(8):  # more new requests than the cache holds
                key = ("evict", ((0, i, 0),))
                agent._new_request(key, attn._peer_names[0], ((attn._local["send/0"], 0, remote, 0, 64 + i),))
        assert agent._writes.get(busy_key) is busy
    finally:
        agent._busy.discard(busy)


def test_live_sources_are_never_evicted_and_a_dead_one_frees_its_slot(pair, monkeypatch):
    ffn, attn = pair
    monkeypatch.setattr(agent_module, "MAX_SOURCES", 1)
    first, second = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
    for layer in range(2):
        for buf in (first, second):
            _, out = _exchange(ffn, attn, buf, layer, lambda h: h * 2)
            assert torch.equal(out, buf * 2)
    [source] = _foreign_sources(attn)  # the cache is full: the second buffer stays on the copy path
    assert source.region.addr == first.untyped_storage().data_ptr()
    del first, source
    gc.collect()
    for layer in range(2, 4):
        _, out = _exchange(ffn, attn, second, layer, lambda h: h * 2)
        assert torch.equal(out, second * 2)
    [source] = _foreign_sources(attn)
    assert source.region.addr == second.untyped_storage().data_ptr()


def test_a_dead_source_not_yet_reaped_is_released_when_its_id_is_registered_again(pair):
    """The race the reaping cannot see: a storage died after this thread checked for dead ones, and a new storage
    with the same id is sent twice. Its registration must replace the dead one's, not leak it."""
    _, attn = pair
    agent = attn._agent
    new = torch.randn(4, HIDDEN)
    storage = new.untyped_storage()
    gone = torch.randn(4, HIDDEN)
    reg = agent.agent.register_memory([gone])
    region = agent_module.Region(gone.data_ptr(), gone.nbytes, 0, "DRAM")
    ref = weakref.ref(gone.untyped_storage())
    del gone
    gc.collect()
    assert ref() is None
    agent._sources[id(storage)] = agent_module._Source(ref, region, reg, False)  # dead, under the new one's id
    generation = agent.generation
    assert agent.source(new) is None  # first sighting
    got = agent.source(new)  # second: registered, the dead entry released first
    assert got is not None and got.addr == storage.data_ptr()
    assert agent.generation == generation + 1
    assert agent._sources[id(storage)].ref() is storage
