"""Conformance suite for async-dispatch (CAM-style) connectors.

The point-to-point suite (:class:`~afd_sdk.testing.ConnectorConformance`)
skips connectors whose world is Attention-first; this one checks the routed
dispatch/combine contract instead, with real processes on loopback::

    from afd_sdk.testing import AsyncDispatchConformance

    class TestMyDispatch(AsyncDispatchConformance):
        connector = "MyEpAFDConnector"
        extra_config = {}

Experts are elementwise maps (:mod:`afd_sdk.testing.dispatch_worker`), so the
combined result must equal the local computation exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from afd_sdk.runtime.world import WorldResult, run_world
from afd_sdk.testing.conformance import loopback_afd

if TYPE_CHECKING:
    from afd_sdk.dispatch import AsyncDispatchConnector

__all__ = ["AsyncDispatchConformance"]

_MODULE = "afd_sdk.testing.dispatch_worker"


class AsyncDispatchConformance:
    """Base class; pytest collects the subclass (its name must start with ``Test``)."""

    #: registered connector name or alias
    connector: ClassVar[str] = ""
    #: ``"module:Class"`` to test a class that is not registered through a plugin
    connector_target: ClassVar[str | None] = None
    #: the connector's ``connector_extra_config``
    extra_config: ClassVar[dict[str, Any]] = {}
    #: deadline for every blocking wait in the workers (some tests set their own, shorter)
    timeout_s: ClassVar[float] = 8.0
    #: ports the connector uses above ``afd.port``
    ports_needed: ClassVar[int] = 16

    @classmethod
    def connector_class(cls) -> type[AsyncDispatchConnector]:
        """The class under test: ``connector_target`` when set, else the plugin registry's ``connector``.

        Called by :meth:`make_spec` in the test process; the workers resolve the same name or target.
        """
        if cls.connector_target:
            from afd_sdk.adapter import resolve_target

            return resolve_target(cls.connector_target, what="connector_target")
        from afd_sdk.plugins import get_plugin_manager

        return get_plugin_manager().connector_class(cls.connector)

    def make_spec(
        self,
        *,
        attention: int = 2,
        ffn: int = 2,
        num_experts: int = 4,
        top_k: int = 2,
        layers: tuple[int, ...] = (1, 2),
        plan: str = "random",
        tokens: int = 5,
        stages: int = 1,
        steps: int = 2,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
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
        afd["compute_gate_on_attention"] = True  # routed dispatch: the router runs on Attention
        moe = {"num_experts": num_experts, "top_k": top_k, "layers": list(layers)}
        return {
            "afd": afd,
            "connector_target": self.connector_target,
            "moe": moe,
            "hidden": 16,
            "plan": plan,
            "tokens": tokens,
            "steps": steps,
        }

    def run(self, spec: dict[str, Any], **kw: Any) -> WorldResult:
        kw.setdefault("timeout_s", 4 * spec["afd"]["timeout_s"] + 60)
        return run_world(spec, module=_MODULE, **kw)

    def assert_exact(self, world: WorldResult, spec: dict[str, Any]) -> None:
        bad = [r for r in world.ranks if not r.ok]
        assert not bad, "ranks failed:\n" + world.describe()
        exchanges = spec["steps"] * len(spec["moe"]["layers"]) * spec["afd"]["num_stages"]
        for r in world.by_role("attention"):
            assert r.result["checks"] == exchanges
            assert r.result["max_abs_diff"] == 0.0, world.describe()
        for r in world.by_role("ffn"):  # one item per exchange, fan-in over every attention rank, then goodbye
            assert len(r.result["items"]) == exchanges, world.describe()

    # --- data path ------------------------------------------------------------------

    @pytest.mark.parametrize(("attention", "ffn", "experts"), [(1, 2, 4), (2, 2, 4), (3, 2, 6), (2, 3, 5)])
    def test_dispatch_combine_exact(self, attention: int, ffn: int, experts: int) -> None:
        spec = self.make_spec(attention=attention, ffn=ffn, num_experts=experts)
        self.assert_exact(self.run(spec), spec)

    def test_micro_batch_stages_in_flight(self) -> None:
        spec = self.make_spec(stages=2, steps=2)
        self.assert_exact(self.run(spec), spec)

    def test_rank_without_tokens_completes_with_empty_items(self) -> None:
        # every token goes to experts 0 and 1 (ffn rank 0): ffn ranks 1 and 2 get empty items every layer
        spec = self.make_spec(attention=2, ffn=3, num_experts=6, plan="skewed")
        world = self.run(spec)
        self.assert_exact(world, spec)
        for r in world.by_role("ffn"):
            rows = {n for _, _, n, _ in r.result["items"]}
            assert rows == ({2 * 2 * 5} if r.rank == 0 else {0}), world.describe()

    def test_zero_token_dispatch(self) -> None:
        spec = self.make_spec(plan="empty")
        world = self.run(spec)
        self.assert_exact(world, spec)

    def test_idle_pause_between_steps_longer_than_timeout(self) -> None:
        # a serving engine without requests: nothing crosses the cut for longer than afd.timeout_s, and the
        # FFN ranks must still be there for the next step (an idle server is not an error)
        spec = self.make_spec(attention=2, ffn=2, timeout_s=2.0)
        spec["pause_s"] = 3.5
        self.assert_exact(self.run(spec), spec)

    # --- failures --------------------------------------------------------------------------

    def test_attention_frozen_between_steps_is_lost(self) -> None:
        # liveness bounds the idle wait: an attention rank frozen between steps (SIGSTOP, resumed after 8 s) is
        # PeerLostError on the FFN ranks before it resumes; waiting it out would end the world cleanly instead
        spec = self.make_spec(attention=1, ffn=2, timeout_s=2.0)
        spec["freeze_s"] = 8.0
        world = self.run(spec)
        for r in world.by_role("ffn"):
            assert r.result.get("error_type") == "PeerLostError", (
                f"ffn rank {r.rank} did not lose the frozen attention rank (error_type "
                f"{r.result.get('error_type')!r}):\n{world.describe()}"
            )

    def test_handshake_mismatch_fails_both_sides(self) -> None:
        spec = self.make_spec(attention=1, ffn=1)
        world = self.run(spec, per_rank={("ffn", 0): {"moe": {**spec["moe"], "top_k": 3}}})
        for r in world.ranks:
            assert r.result.get("error_type") == "HandshakeError", world.describe()
            assert "top_k" in r.result["error_message"]

    def test_attention_killed_mid_step(self) -> None:
        spec = self.make_spec(attention=1, ffn=2, timeout_s=5.0)
        world = self.run(spec, per_rank={("attention", 0): {"die_at": [1, 2]}})
        (attn,) = world.by_role("attention")
        assert attn.returncode == 3
        for r in world.by_role("ffn"):
            assert r.result.get("error_type") == "PeerLostError", world.describe()
