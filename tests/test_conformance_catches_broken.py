"""The connector suite must fail broken connectors, not only pass good ones.

A plain-TCP connector written from outside on the public transport kit
(``docs/examples/tcp_connector.py``) passes it; two broken variants that once
passed the suite 14/14 must now fail it:

* a connector that reports no control plane (the FFN server cannot know a
  step's work): every exchange test fails;
* a connector whose FFN send blocks until the attention side reads: it
  deadlocks on two interleaved stages of 16 MiB payloads;
* a connector that memoises its send checks by stage (it skips them for a
  stage that passed them once): the misuse test repeats its misuse after a
  whole step;
* a connector that sends each tensor from the start of its storage: the
  static-buffer test sends views at an offset into a reused buffer;
* connectors that leave a thread or a socket behind at every close: the
  lifecycle test compares what two init/close cycles left.

The async-dispatch suite likewise fails a CAM whose FFN times out while the
world idles between steps, and one that waits out a frozen attention rank.
"""

import os
from pathlib import Path

import pytest

from afd_sdk.testing import AsyncDispatchConformance, ConnectorConformance

pytestmark = pytest.mark.multiprocess

EXAMPLES = str(Path(__file__).resolve().parents[1] / "docs" / "examples")
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [EXAMPLES, os.environ.get("PYTHONPATH")]))}


class _Tcp(ConnectorConformance):
    connector = "TcpAFDConnector"
    connector_target = "tcp_connector:TcpAFDConnector"
    timeout_s = 5.0

    @classmethod
    def connector_class(cls):
        import sys

        if EXAMPLES not in sys.path:
            sys.path.insert(0, EXAMPLES)
        return super().connector_class()

    def run(self, spec, **kw):
        kw.setdefault("env", ENV)
        return super().run(spec, **kw)


@pytest.mark.slow  # CI time: the cases below run the same example connector through the suite's exchange tests
class TestTcpReferenceConnector(_Tcp):
    """The example connector of the guide passes the whole suite."""


def test_blocking_ffn_send_passes_small_payloads_but_fails_the_large_interleaved_test():
    suite = _Tcp()
    small = suite.make_spec("roundtrip", stages=2, layers=2, steps=1)
    small["afd"]["connector_extra_config"] = {"blocking_ffn_send": True}
    suite.assert_all_ok(suite.run(small))  # small payloads fit the socket buffers: the flaw hides
    with pytest.raises(AssertionError, match="ranks failed"):
        suite.test_large_payloads_interleaved_stages(extra_config={"blocking_ffn_send": True})


def test_a_connector_without_control_plane_fails_the_suite():
    class NoPlane(_Tcp):
        connector = "NoControlPlaneTcpConnector"
        connector_target = "tcp_connector:NoControlPlaneTcpConnector"

    suite = NoPlane()
    world = suite.run(suite.make_spec("roundtrip", steps=1, layers=1))
    with pytest.raises(AssertionError, match="ranks failed"):
        suite.assert_all_ok(world)
    (attn,) = world.by_role("attention")
    assert attn.error_type == "ConnectorError" and "no control plane" in attn.result["error_message"]


def test_a_connector_that_memoises_its_checks_by_stage_fails_the_misuse_test():
    class Memoising(_Tcp):
        connector = "MemoisingTcpConnector"
        connector_target = "tcp_connector:MemoisingTcpConnector"

    with pytest.raises(AssertionError):
        Memoising().test_local_misuse_raises_clear_errors()


def test_a_connector_that_sends_from_the_storage_start_fails_only_the_static_buffer_test():
    class StorageStart(_Tcp):
        connector = "StorageStartTcpConnector"
        connector_target = "tcp_connector:StorageStartTcpConnector"

    suite = StorageStart()
    suite.test_roundtrip_multi_layer_multi_stage()  # fresh tensors start their storage: the flaw hides
    with pytest.raises(AssertionError, match="ranks failed"):
        suite.test_static_buffers_and_views_are_sent_by_value()


@pytest.mark.parametrize(
    ("target", "leak"), [("ThreadLeakingTcpConnector", "thread leak"), ("FdLeakingTcpConnector", "fd leak")]
)
def test_a_connector_that_leaks_at_every_close_fails_the_lifecycle_test(target, leak):
    class Leaking(_Tcp):
        connector = target
        connector_target = f"tcp_connector:{target}"

    with pytest.raises(AssertionError, match=leak):
        Leaking().test_lifecycle_reinit_and_no_leaks()


# --- the async-dispatch (routed, CAM-style) suite ---------------------------------------------------------

TESTS = str(Path(__file__).resolve().parent)


class _CamVariant(AsyncDispatchConformance):
    extra_config = {"backend": "portable"}

    def run(self, spec, **kw):
        kw.setdefault("env", {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))})
        return super().run(spec, **kw)


def test_a_dispatch_connector_whose_ffn_times_out_between_steps_fails_the_idle_pause_test():
    class Deadline(_CamVariant):
        connector_target = "cam_variants:DeadlineBetweenSteps"

    with pytest.raises(AssertionError, match="ranks failed"):
        Deadline().test_idle_pause_between_steps_longer_than_timeout()


def test_a_dispatch_connector_that_waits_out_a_frozen_peer_fails_the_frozen_attention_test():
    class WaitsForever(_CamVariant):
        connector_target = "cam_variants:NoLivenessBetweenSteps"

    with pytest.raises(AssertionError, match="did not lose the frozen attention rank"):
        WaitsForever().test_attention_frozen_between_steps_is_lost()
