"""``afd bench connector --profile``'s accounting, without processes."""

from afd_sdk.bench.roundtrip_profile import profile_attention, profile_ffn


def test_the_profiled_block_replays_the_timed_blocks_indices():
    """Both halves must see the steady state: a layer the timed block used has its plan built and caches hot."""
    sent: list[int] = []
    out = profile_attention(sent.append, lambda: None, 5)
    assert sent == [0, 1, 2, 3, 4] * 2
    assert {"send_us", "recv_us", "rt_us", "thread_cpu_us", "functions"} <= out.keys()
    assert out["functions"] and all(f.keys() == {"function", "own_us", "calls"} for f in out["functions"])


def test_between_runs_once_between_the_timed_and_the_profiled_block():
    events: list[object] = []
    profile_attention(events.append, lambda: None, 2, between=lambda: events.append("next step"))
    assert events == [0, 1, "next step", 0, 1]


def test_ffn_profile_times_receive_then_send_per_message():
    order: list[str] = []
    out = profile_ffn(lambda: order.append("recv") or 7, lambda got: order.append(f"send {got}"), None, 3)
    assert order == ["recv", "send 7"] * 6
    assert {"recv_us", "recv_cpu_us", "send_us", "send_cpu_us", "functions"} <= out.keys()
