"""The connector conformance suite, shipped for third-party connector authors.

Subclass :class:`ConnectorConformance` in your own test module (fsspec /
SQLAlchemy style) and name your connector::

    from afd_sdk.testing import ConnectorConformance

    class TestMyConnector(ConnectorConformance):
        connector = "MyRdmaAFDConnector"          # registered name or alias
        extra_config = {"transport": "tcp"}       # its connector_extra_config

Every test starts real processes on loopback (one fresh interpreter per rank)
and checks value-exact results. The connector's ``capabilities`` decide skips,
and each skip says why. Override :meth:`make_spec` to adjust the model, token
plan or timeouts.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from afd_sdk.connector import AFDConnector, ConnectorBase
from afd_sdk.runtime.world import WorldResult, free_port_block, run_world

__all__ = ["ConnectorConformance"]

DTYPES = ("float32", "bfloat16", "float16", "int8")


def loopback_afd(
    name: str,
    connector_cls: type[ConnectorBase],
    extra_config: dict[str, Any],
    *,
    ports: int,
    attention: int,
    ffn: int,
    stages: int,
    timeout_s: float,
) -> dict[str, Any]:
    """The ``afd`` mapping of a conformance world on loopback, on a fresh block of ``ports`` free ports."""
    return {
        "connector": name,
        "host": "127.0.0.1",
        "port": free_port_block(ports),
        "num_attention_ranks": attention,
        "num_ffn_ranks": ffn,
        "num_stages": stages,
        "timeout_s": timeout_s,
        "connect_timeout_s": timeout_s,  # a test world's peers start together: a missing one fails as fast
        "connector_extra_config": {**extra_config, **connector_cls.stage_extra_config(stages)},
    }


class ConnectorConformance:
    """Base class of the suite; pytest collects the subclass (its name must start with ``Test``)."""

    #: registered connector name or alias
    connector: ClassVar[str] = ""
    #: ``"module:Class"`` to test a class that is not registered through a plugin
    connector_target: ClassVar[str | None] = None
    #: the connector's ``connector_extra_config``
    extra_config: ClassVar[dict[str, Any]] = {}
    #: deadline for every blocking wait in the workers
    timeout_s: ClassVar[float] = 8.0
    #: ports the connector uses above ``afd.port`` for A, F, stages (default generous)
    ports_needed: ClassVar[int] = 64

    # --- helpers --------------------------------------------------------------

    @classmethod
    def connector_class(cls) -> type[AFDConnector]:
        if cls.connector_target:
            from afd_sdk.adapter import resolve_target

            return resolve_target(cls.connector_target, what="connector_target")
        from afd_sdk.plugins import get_plugin_manager

        return get_plugin_manager().connector_class(cls.connector)

    def make_spec(
        self,
        scenario: str,
        *,
        attention: int = 1,
        ffn: int = 1,
        stages: int = 1,
        dtype: str = "float32",
        extras: list[dict[str, Any]] | None = None,
        tokens: list[int] | None = None,
        layers: int = 3,
        hidden: int = 32,
        steps: int = 2,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """The world spec handed to every rank; see :mod:`afd_sdk.testing.worker`."""
        afd = loopback_afd(
            self.connector or "unregistered",
            self.connector_class(),
            self.extra_config,
            ports=self.ports_needed,
            attention=attention,
            ffn=ffn,
            stages=stages,
            timeout_s=timeout_s or self.timeout_s,
        )
        return {
            "afd": afd,
            "connector_target": self.connector_target,
            "scenario": scenario,
            "model": {"architecture": "ConformanceModel", "hidden_size": hidden, "dtype": dtype, "num_layers": layers},
            "extras": extras or [],
            "tokens": tokens or [5, 3, 8, 1],
            "steps": steps,
        }

    def run(self, spec: dict[str, Any], **kw: Any) -> WorldResult:
        kw.setdefault("timeout_s", 4 * spec["afd"]["timeout_s"] + 60)
        return run_world(spec, module="afd_sdk.testing.worker", **kw)

    def assert_all_ok(self, world: WorldResult) -> None:
        bad = [r for r in world.ranks if not r.ok]
        assert not bad, "ranks failed:\n" + world.describe()
        assert all(r.result.get("checks", 0) > 0 for r in world.ranks), "a rank checked nothing:\n" + world.describe()

    def require_ffn_first(self) -> None:
        caps = self.connector_class().capabilities
        if caps.world_layout != "ffn_first":
            hint = "; its routed dispatch is checked by AsyncDispatchConformance" if caps.async_dispatch else ""
            pytest.skip(f"{self.connector}: world_layout={caps.world_layout!r}; these exchanges are FFN-first{hint}")

    def require_dtype(self, dtype: str) -> None:
        caps = self.connector_class().capabilities
        if dtype not in caps.dtypes:
            pytest.skip(f"{self.connector} does not declare dtype {dtype} in capabilities.dtypes")

    # --- round trips ------------------------------------------------------------

    def test_roundtrip_multi_layer_multi_stage(self) -> None:
        self.require_ffn_first()
        world = self.run(self.make_spec("roundtrip", stages=2, layers=4, steps=3))
        self.assert_all_ok(world)
        (attn,) = world.by_role("attention")
        assert attn.result["checks"] == 3 * 4 * 2

    def test_fan_in_uneven_tokens(self) -> None:
        self.require_ffn_first()
        world = self.run(self.make_spec("roundtrip", attention=3, ffn=2, tokens=[7, 2, 5, 11, 1], steps=2))
        self.assert_all_ok(world)

    def test_zero_token_stages(self) -> None:
        self.require_ffn_first()
        world = self.run(self.make_spec("roundtrip", attention=2, stages=2, tokens=[0, 4, 0, 0, 3], steps=3))
        self.assert_all_ok(world)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_dtypes(self, dtype: str) -> None:
        self.require_ffn_first()
        self.require_dtype(dtype)
        self.assert_all_ok(self.run(self.make_spec("roundtrip", dtype=dtype, layers=2)))

    def test_extras_round_trip(self) -> None:
        self.require_ffn_first()
        if not self.connector_class().capabilities.supports_extras:
            pytest.skip(f"{self.connector} declares supports_extras=False")
        extras = [
            {"name": "input_ids", "dtype": "int32"},
            {"name": "topk_weights", "dtype": "float32", "trailing_shape": [2]},
        ]
        spec = self.make_spec("roundtrip", attention=2, extras=extras, stages=2, tokens=[5, 0, 3, 8, 1])
        self.assert_all_ok(self.run(spec))  # a zero-token stage carries empty extras too

    def test_roles_sized_for_different_max_num_tokens(self) -> None:
        """The attention ranks size their buffers for fewer tokens than the FFN side, with fan-in and extras.

        That is every ``vllm serve`` deployment: an engine sizes from its own ``max_num_batched_tokens``, a
        standalone FFN server from its own. A connector that lays out the FFN's receive buffers from each side's
        own ``max_num_tokens`` (and so writes extras or a fan-in peer's rows at the wrong offsets, or refuses
        the peer) fails here; the values must be exact.
        """
        self.require_ffn_first()
        extras: list[dict[str, Any]] = []
        if self.connector_class().capabilities.supports_extras:
            extras = [
                {"name": "input_ids", "dtype": "int32"},
                {"name": "topk_weights", "dtype": "float32", "trailing_shape": [2]},
            ]
        spec = self.make_spec("roundtrip", attention=2, extras=extras, stages=2, tokens=[5, 0, 8, 3, 1], steps=2)
        spec["max_num_tokens"] = {"attention": 8, "ffn": 64}
        self.assert_all_ok(self.run(spec))

    def test_static_buffers_and_views_are_sent_by_value(self) -> None:
        """Hidden states sent from buffers the attention side reuses every layer, and from views at an offset.

        Runners with preallocated activations (vLLM's CUDA graphs) send the
        same memory every layer with new contents; the contract lets the caller
        refill it once ``recv_ffn_output`` returned. A connector that caches
        what it sent by address, or reads a tensor from the start of its
        storage instead of its own first element, sends stale or wrong rows
        here. The FFN answers from views at an offset into fresh buffers too.
        3A2F: one FFN rank serves two attention peers (fan-in) and the other one, and connectors take other paths
        for each.
        """
        self.require_ffn_first()
        spec = self.make_spec("static_buffers", attention=3, ffn=2, stages=2, layers=6, steps=2, tokens=[5, 3, 8, 1])
        world = self.run(spec)
        self.assert_all_ok(world)
        for attn in world.by_role("attention"):
            assert attn.result["checks"] == 2 * 6 * 2, world.describe()

    def test_large_payloads_interleaved_stages(self, extra_config: dict[str, Any] | None = None) -> None:
        """Two stages of 16 MiB each way, every stage sent before any is received.

        That is how the runner overlaps micro-batches. A connector whose send
        waits for the peer to *receive* (a blocking socket write, a rendezvous
        send) deadlocks here once payloads outgrow the transport's buffers,
        which the small tensors of the other tests never do.
        """
        self.require_ffn_first()
        self.require_dtype("float32")
        spec = self.make_spec("roundtrip", stages=2, layers=2, steps=1, hidden=4096, tokens=[1024])
        spec["max_num_tokens"] = 1024  # 1024 tokens x 4096 x fp32 = 16 MiB per message
        if extra_config is not None:
            spec["afd"]["connector_extra_config"] = {**spec["afd"]["connector_extra_config"], **extra_config}
        self.assert_all_ok(self.run(spec))

    # --- errors -----------------------------------------------------------------

    def test_local_misuse_raises_clear_errors(self) -> None:
        self.require_ffn_first()
        spec = self.make_spec("local_errors", extras=[{"name": "input_ids", "dtype": "int32"}], steps=1)
        if not self.connector_class().capabilities.supports_extras:
            spec["extras"] = []
        world = self.run(spec)
        (attn,) = world.by_role("attention")
        (ffn,) = world.by_role("ffn")
        assert attn.ok and ffn.ok, world.describe()
        errors = {**attn.result["expected_errors"], **ffn.result["expected_errors"]}
        expected = [
            "recv_before_send",
            "wrong_hidden_size",
            "seq_lens_mismatch",
            "stage_out_of_range",
            "ffn_wrong_rows",
        ]
        if spec["extras"]:
            expected.append("missing_extras")
        # the same misuse once a whole step ran: memoised checks must still refuse it
        expected += [f"{label}_steady" for label in expected]
        for label in expected:
            kind, message = errors[label]
            assert kind == "ConnectorError", f"{label}: expected ConnectorError, got {kind}: {message}"
            assert message, f"{label}: the error has no message"

    def test_handshake_mismatch(self) -> None:
        self.require_ffn_first()
        spec = self.make_spec("roundtrip")
        wrong_model = {**spec["model"], "hidden_size": 64}
        world = self.run(spec, per_rank={("attention", 0): {"model": wrong_model}})
        for r in world.ranks:
            assert r.error_type == "HandshakeError", world.describe()
            assert "hidden_size" in r.result["error_message"] and "64" in r.result["error_message"], world.describe()
            assert "32" in r.result["error_message"], world.describe()

    @pytest.mark.parametrize("victim", ["ffn", "attention"])
    def test_peer_killed_mid_step(self, victim: str) -> None:
        self.require_ffn_first()
        spec = self.make_spec("roundtrip", layers=4, steps=2, timeout_s=5.0)
        spec["die"] = {"role": victim, "at_layer": 1}
        world = self.run(spec)
        (dead,) = world.by_role(victim)
        (survivor,) = world.by_role("attention" if victim == "ffn" else "ffn")
        assert dead.returncode == -9, world.describe()
        assert survivor.returncode == 1 and survivor.error_type == "PeerLostError", world.describe()
        assert survivor.result["error_after_wait_s"] <= spec["afd"]["timeout_s"] + 2.0, world.describe()

    # --- lifecycle ----------------------------------------------------------------

    def test_lifecycle_reinit_and_no_leaks(self) -> None:
        self.require_ffn_first()
        world = self.run(self.make_spec("lifecycle", layers=2))
        assert all(r.ok for r in world.ranks), world.describe()
        for r in world.ranks:
            res = r.result
            assert res["is_initialized_after_close"] is False
            # the second init/close cycle must leave exactly what the first left
            assert res["after"]["fds"] == res["after_first"]["fds"], f"fd leak: {res}"
            assert res["after"]["threads"] == res["after_first"]["threads"], f"thread leak: {res}"
            assert res["after"]["py_threads"] == res["before"]["py_threads"], f"python thread leak: {res}"

    def test_close_after_failed_init(self) -> None:
        self.require_ffn_first()
        spec = self.make_spec("init_fails", timeout_s=1.5)
        world = self.run(spec, roles=("attention",))
        (attn,) = world.by_role("attention")
        assert attn.ok, world.describe()
        kind, message, elapsed = attn.result["init_error"]
        assert kind == "PeerLostError", message
        assert elapsed <= spec["afd"]["connect_timeout_s"] + 2.0
