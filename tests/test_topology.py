import pytest

from afd_sdk.errors import TopologyError
from afd_sdk.topology import attention_first_world, even_blocks, ffn_first_world, role_rank


def test_role_rank_formula():
    assert role_rank(dp_rank=1, pcp_rank=1, tp_rank=2, dp_size=2, pcp_size=2, tp_size=4) == (1 * 2 + 1) * 4 + 2
    with pytest.raises(TopologyError, match=r"tp_rank=4 is out of range; expected an integer \[0, 3\]"):
        role_rank(dp_rank=0, pcp_rank=0, tp_rank=4, dp_size=1, pcp_size=1, tp_size=4)


def test_even_blocks():
    assert even_blocks(5, 2) == ((0, 3), (3, 5))
    assert even_blocks(4, 4) == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert even_blocks(7, 3) == ((0, 3), (3, 5), (5, 7))


def test_ffn_first_any_a_ge_f():
    w = ffn_first_world(5, 2)
    assert w.world_size == 7
    assert w.attention_for_ffn(0) == (0, 1, 2) and w.attention_for_ffn(1) == (3, 4)
    assert [w.ffn_for_attention(a) for a in range(5)] == [0, 0, 0, 1, 1]
    assert w.global_rank("ffn", 1) == 1 and w.global_rank("attention", 0) == 2
    covered = sorted(a for f in range(2) for a in w.attention_for_ffn(f))
    assert covered == list(range(5))


def test_ffn_first_rejects_a_lt_f():
    with pytest.raises(TopologyError, match="num_attention_ranks=1 < num_ffn_ranks=2.*CAMAsyncAFDConnector"):
        ffn_first_world(1, 2)


def test_attention_first_expert_placement():
    w = attention_first_world(2, 3, 10)
    assert [list(w.local_experts(f)) for f in range(3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [w.expert_owner(e) for e in (0, 3, 4, 9)] == [0, 0, 1, 2]
    assert w.global_rank("attention", 1) == 1 and w.global_rank("ffn", 0) == 2
    with pytest.raises(TopologyError, match="num_experts=2 < num_ffn_ranks=3"):
        attention_first_world(1, 3, 2)


def test_as_dict_lists_every_rank():
    d = ffn_first_world(3, 2).as_dict()
    assert [r["global_rank"] for r in d["ranks"]] == [0, 1, 2, 3, 4]
