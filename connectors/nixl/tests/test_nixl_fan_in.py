"""Fan-in over NIXL: attention ranks write straight into their slices, the FFN computes on its receive region."""

import threading

import pytest
import torch

from afd_sdk.errors import ConnectorError, PeerLostError
from afd_sdk.runtime.attention_runner import announce_step
from afd_sdk.runtime.session import connector_from_spec
from afd_sdk.runtime.world import free_port_block
from afd_sdk.testing import init_in_threads
from afd_sdk.wire import ControlPayload, TransferMetadata

HIDDEN = 8


@pytest.fixture
def world():
    """One FFN rank with two attention peers (NIXL agents of one process), one stage, hidden 8, 16 tokens each."""
    port = free_port_block(16)
    spec = {
        "afd": {
            "connector": "nixl",
            "port": port,
            "timeout_s": 5,
            "num_attention_ranks": 2,
            "connector_extra_config": {"spin_us": 100},
        },
        "model": {"architecture": "T", "hidden_size": HIDDEN, "dtype": "float32", "num_layers": 4},
        "max_num_tokens": 16,
    }
    ffn = connector_from_spec({**spec, "role": "ffn", "rank": 0})
    attn = [connector_from_spec({**spec, "role": "attention", "rank": r}) for r in range(2)]
    init_in_threads(ffn, attn)
    yield ffn, attn
    for c in (*attn, ffn):
        c.close()


def _exchange(ffn, attn, counts, step, layer):
    """One step of one layer: both ranks send ``counts`` tokens; the FFN doubles the batch; each gets its rows.

    The FFN side runs in a thread, as in its own process: with NIXL's progress thread off, its notifications
    (the row offsets among them) leave while it polls for the hidden states.
    """
    xs = [torch.randn(n, HIDDEN) for n in counts]
    for a, n in zip(attn, counts, strict=True):
        announce_step(a, ControlPayload(step, ((n,),), n, 1))
    got = []

    def serve():
        cp = ffn.require_control_plane()
        cp.apply(cp.recv(timeout_s=5))  # the FFN tells each peer its first row now
        payload = ffn.recv_attn_output(0)
        got.append((payload.metadata, payload.hidden_states.clone(), payload.hidden_states.data_ptr()))
        ffn.send_ffn_output(payload.hidden_states * 2, payload.metadata)

    server = threading.Thread(target=serve)
    server.start()
    for a, x, n in zip(attn, xs, counts, strict=True):
        a.send_attn_output(x, TransferMetadata(layer, 0, (n,)))
    outs = [a.recv_ffn_output(x, 0).clone() for a, x in zip(attn, xs, strict=True)]
    server.join(10)
    return xs, got[0], outs


def test_peers_land_concatenated_in_the_receive_region_without_a_gather(world):
    ffn, attn = world
    region = ffn._tensors["a2f/0"]
    for step, counts in enumerate([(3, 5), (0, 7), (16, 16), (4, 0)]):  # uneven, empty and full stages
        xs, (metadata, hidden, start), outs = _exchange(ffn, attn, counts, step, 0)
        assert metadata.seq_lens == counts
        assert torch.equal(hidden, torch.cat(xs))
        # the batch is the receive region itself: rank 1's rows were written right behind rank 0's
        assert region.data_ptr() <= start < region.data_ptr() + region.nbytes
        for out, x in zip(outs, xs, strict=True):
            assert torch.equal(out, x * 2)


def test_an_attention_rank_without_its_row_offset_times_out(world):
    _ffn, attn = world
    for a in attn:
        announce_step(a, ControlPayload(0, ((2,),), 2, 1))
    # the FFN never applies the step, so no row offset is sent: the write cannot know where to go
    with pytest.raises(PeerLostError, match="row offset of step 0, stage 0"):
        attn[0].send_attn_output(torch.randn(2, HIDDEN), TransferMetadata(0, 0, (2,)))


def test_an_ffn_sized_for_fewer_tokens_than_its_peer_fails_at_init():
    """An FFN side smaller than its attention peer cannot hold what the peer may send: refused at init, naming
    both sizes (the other way round is what every `vllm serve` deployment does, and works: the kit's
    test_roles_sized_for_different_max_num_tokens)."""
    port = free_port_block(16)
    spec = {
        "afd": {"connector": "nixl", "port": port, "timeout_s": 5},
        "model": {"architecture": "T", "hidden_size": HIDDEN, "dtype": "float32", "num_layers": 4},
    }
    ffn = connector_from_spec({**spec, "role": "ffn", "rank": 0, "max_num_tokens": 16})
    attn = connector_from_spec({**spec, "role": "attention", "rank": 0, "max_num_tokens": 32})
    ffn_outcome: list[BaseException | None] = []

    def ffn_init() -> None:
        try:
            ffn.init()
            ffn_outcome.append(None)
        except BaseException as exc:  # asserted below
            ffn_outcome.append(exc)

    t = threading.Thread(target=ffn_init, daemon=True)
    t.start()
    try:
        with pytest.raises(ConnectorError, match="hold max_num_tokens=16 rows .* may send max_num_tokens=32"):
            attn.init()
    finally:
        attn.close()
        t.join(15)
        ffn.close()
    # the FFN side finished its own set-up (the mismatch is the attention side's to find), or saw its peer leave
    assert len(ffn_outcome) == 1
    assert ffn_outcome[0] is None or isinstance(ffn_outcome[0], PeerLostError), repr(ffn_outcome[0])
