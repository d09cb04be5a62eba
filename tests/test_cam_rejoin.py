"""The pieces of a CAM rejoin that run in one process: the routing table going back, and the heartbeat following
a new incarnation's keys (the whole rejoin runs in ``tests/test_cam_redundant.py``)."""

from __future__ import annotations

import datetime
import time
import types

import torch

from afd_connectors.cam.liveness import StoreHeartbeat, rank_key
from afd_connectors.cam.routing import ExpertRouting
from afd_sdk.runtime.world import free_port_block
from afd_sdk.topology import build_world


def test_a_rejoined_rank_gets_its_experts_back_with_a_new_epoch():
    world = build_world("attention_first", 2, 4, num_experts=8, expert_replicas=2)
    routing = ExpertRouting(world, torch.device("cpu"), "test")
    before = routing.route
    routing.lose(1, "killed")
    assert routing.route != before and 1 not in routing.targets
    routing.restore(1)
    assert routing.route == before and routing.targets == (0, 1, 2, 3) and routing.sort_key is None
    assert routing.epoch == 2 and routing.lost_snapshot == frozenset()
    routing.restore(1)  # not lost: nothing changes
    assert routing.epoch == 2


def test_incarnation_keys_keep_the_first_incarnations_names():
    assert rank_key("ns", "hb", 3) == "ns/hb/3"
    assert rank_key("ns", "fenced", 3, 2) == "ns/fenced/3.2"


def _wait_for(cond, what: str, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_the_heartbeat_sees_a_join_and_follows_the_new_incarnation():
    """An attention rank's heartbeat reads a join announcement; after ``readmit`` it judges the peer by the new
    incarnation's counter (the old one's no longer counts) and fences the new incarnation's key."""
    import torch.distributed as dist

    port = free_port_block(1)
    ns = f"afd-cam/{port}"
    master = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False
    )
    hb = StoreHeartbeat(
        host="127.0.0.1",
        port=port,
        namespace=ns,
        me=0,
        peers={1: "ffn rank 0"},
        timeout_s=0.6,
        owner="test",
        watch_drains=True,
    )
    hb.start()
    try:
        master.set(f"{ns}/draining/1", "1")  # the old incarnation drained
        master.add(f"{ns}/drains", 1)
        _wait_for(lambda: hb.draining == frozenset({1}), "the drain was not read")
        master.set(f"{ns}/joining/1", "1")
        master.add(f"{ns}/joins", 1)
        _wait_for(lambda: hb.joining == frozenset({(1, 1)}), "the join was not read")
        hb.retire(1)
        hb.readmit(1, 1)
        assert hb.joining == frozenset() and hb.draining == frozenset()
        # the old incarnation's counter moves, the new one's does not: lost after the limit
        deadline = time.monotonic() + 10
        while not hb.lost_ranks():
            assert time.monotonic() < deadline, "a silent new incarnation was never lost"
            master.add(f"{ns}/hb/1", 1)
            time.sleep(0.05)
        # the new incarnation beats: alive again
        deadline = time.monotonic() + 10
        while hb.lost_ranks():
            assert time.monotonic() < deadline, "the new incarnation's beats were not read"
            master.add(f"{ns}/hb/1.1", 1)
            time.sleep(0.05)
        hb.fence(1)
        _wait_for(lambda: master.check([f"{ns}/fenced/1.1"]), "the new incarnation was not fenced")
        assert not master.check([f"{ns}/fenced/1"])
    finally:
        hb.stop()


class _Liveness:
    joining: frozenset = frozenset()


def _admission(port: int, num_attention: int = 2):
    """A :class:`JoinAdmission` of attention rank 0 on a real store, with joins put in by hand (no groups form)."""
    import torch.distributed as dist

    from afd_connectors.cam.rejoin import JoinAdmission

    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False
    )
    conn = types.SimpleNamespace(
        name="test",
        role="attention",
        role_rank=0,
        world=types.SimpleNamespace(num_attention=num_attention),
        config=types.SimpleNamespace(connect_timeout_s=5.0, timeout_s=1.0),
    )
    return JoinAdmission(conn, store, "ns", _Liveness()), store


def test_the_step_is_agreed_once_every_rank_is_ready_and_holds_for_every_rank():
    from afd_connectors.cam.rejoin import _Join

    admission, store = _admission(free_port_block(1))
    groups = [object()]
    join = admission._joins[1] = _Join(1, 1, time.monotonic() + 60, groups=groups)
    assert admission.at_boundary(5, {1}) == [] and join.admit_step is None  # nobody ready yet
    store.set("ns/ready/1.1/0", "1")
    store.set("ns/ready/1.1/1", "1")
    assert admission.at_boundary(6, {1}) == [] and join.admit_step == 8  # proposed: two steps ahead
    assert store.get("ns/admit/1.1") == b"8"
    assert admission.at_boundary(7, {1}) == []
    assert admission.at_boundary(8, {1}) == [(1, 1, groups)]
    assert admission.at_boundary(9, {1}) == []  # admitted once


def test_a_join_past_its_deadline_is_cancelled_unless_a_step_was_agreed():
    from afd_connectors.cam.rejoin import _Join

    admission, store = _admission(free_port_block(1))
    late = admission._joins[1] = _Join(1, 1, time.monotonic() - 1, groups=[object()])
    assert admission.at_boundary(3, {1}) == []
    assert late.error == "timed out" and late.groups is None and store.get("ns/admit/1.1") == b"cancelled"
    # another attention rank's side of the same join (put in by hand again), every rank ready at a later boundary:
    # it finds the join cancelled, so no rank ever admits it
    again = admission._joins[1] = _Join(1, 1, time.monotonic() + 60, groups=[object()])
    store.set("ns/ready/1.1/0", "1")
    store.set("ns/ready/1.1/1", "1")
    assert admission.at_boundary(4, {1}) == [] and again.error == "cancelled by another attention rank"
    # a step agreed first wins over a late cancel
    store.set("ns/admit/1.2", "12")
    agreed = admission._joins[1] = _Join(1, 2, time.monotonic() - 1, groups=[object()])
    assert admission.at_boundary(11, {1}) == [] and agreed.admit_step == 12 and agreed.error is None
    assert admission.at_boundary(12, {1})[0][:2] == (1, 2)
