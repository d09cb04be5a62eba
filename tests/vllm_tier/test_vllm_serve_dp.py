"""vLLM's data-parallel group is one AFD world: ``vllm serve --data-parallel-size 2`` against one FFN server.

Per connector (zmq, p2p, shm, NIXL, and CAM's routed dispatch), one deployment of real processes on the serving
tests' tiny Qwen3-MoE:

* ``attn`` — ``vllm serve --data-parallel-size 2`` with ``afd.num_attention_ranks=2``: DP rank r is attention
  rank r, each engine exports AFD metrics on ``afd.metrics_port + r`` (its local DP rank);
* ``ffn`` — ``afd ffn serve --engine vllm`` of the same world, fanning the two ranks in (CAM: an FFN pool of
  two ``afd ffn serve --rank f``, each holding half of the routed experts);
* the reference is the session's native single engine (conftest.py): native DP with an MoE does not run on
  vLLM's CPU communicator (``all_gatherv`` is not implemented there).

vLLM steps the DP ranks of an MoE model in lockstep: a rank without requests runs a one-token dummy batch
whenever another rank runs a real one. Those dummy tokens cross the cut like any others (a real forward of
the proxy), so every FFN call merges exactly one announcement per rank and an idle rank never stalls the
busy one; vLLM discards the dummy's output. The tests check what that promises: outputs equal native with
requests on both ranks and with one rank idle, an idle pause is survived, and the FFN made one call per
layer-step for the two ranks together (its exchange count equals each rank's, not their sum).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed here; run the tier with scripts/bootstrap-vllm.sh (tests/vllm_tier)"
)
openai = pytest.importorskip("openai", reason="the OpenAI client comes with the vLLM tier (constraints/vllm-tier.txt)")

from nixl_available import nixl_missing  # noqa: E402
from serve_client import (  # noqa: E402
    PROMPTS,
    afd_sample,
    assert_same,
    complete,
    complete_many,
    engine_requests,
    scrape,
    settled,
)
from serve_processes import BIN, ENGINE, Server  # noqa: E402

from afd_sdk.integrations.vllm.serve import serve_argv  # noqa: E402
from afd_sdk.runtime.world import free_port_block  # noqa: E402

pytestmark = pytest.mark.timeout(900)

TIMEOUT_S = 5.0
START_S = 300.0
DP = 2


#: keys a connector needs besides its name: routed dispatch runs the router on Attention, its experts sharded over
#: an FFN pool of two ranks (two `afd ffn serve --rank f` processes)
CONNECTOR_KEYS = {"CAMAsyncAFDConnector": {"compute_gate_on_attention": True, "num_ffn_ranks": 2}}


class DPDeployment:
    def __init__(self, tmp, model: str, connector: str) -> None:
        self.connector = connector
        self.http = free_port_block(1)
        self.afd_port = free_port_block(16)
        keys = CONNECTOR_KEYS.get(connector, {})
        ffn_ranks = keys.get("num_ffn_ranks", 1)
        self.metrics = free_port_block(DP + ffn_ranks)  # attention ranks: metrics + r; FFN rank f: metrics + DP + f
        self.ffn_metrics = [self.metrics + DP + f for f in range(ffn_ranks)]
        afd = {
            "connector": connector,
            "host": "127.0.0.1",
            "port": self.afd_port,
            "num_attention_ranks": DP,
            "timeout_s": TIMEOUT_S,
            **keys,
        }
        argv = serve_argv(
            model,
            {**afd, "metrics_port": self.metrics},
            port=self.http,
            executable=str(BIN / "vllm"),
            data_parallel_size=DP,
            data_parallel_address="127.0.0.1",
            data_parallel_rpc_port=free_port_block(1),
            api_server_count=1,  # one API server for the group (vLLM starts one per DP rank by default)
            **ENGINE,
        )
        self.attn = Server(f"attn-dp-{connector}", argv, tmp, http_port=self.http)
        self.ffns: list[Server] = []
        try:
            for f, mport in enumerate(self.ffn_metrics):
                ffn_argv = [str(BIN / "afd"), "ffn", "serve", "--engine", "vllm", "--model", model, "--rank", str(f)]
                ffn_argv += ["--config", json.dumps(afd), "--metrics-port", str(mport)]
                self.ffns.append(Server(f"ffn{f}-dp-{connector}", ffn_argv, tmp))
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.attn.stop()
        for ffn in self.ffns:
            ffn.stop()

    def logs(self) -> str:
        return "\n".join([*(ffn.log() for ffn in self.ffns), self.attn.log()])

    def sample(self, endpoint: int, name: str, **labels: str) -> float:
        return afd_sample(endpoint, name, port=str(self.afd_port), **labels)

    def exchanges(self) -> tuple[float, list[float]]:
        """The FFN ranks' exchange count and each attention rank's, stage 0, once the group stopped stepping.

        Every FFN rank of a pool takes part in every layer-step (routed dispatch sends each a header, maybe of
        zero rows), so all FFN ranks count the same; a disagreement is returned as NaN and never settles.
        """
        return settled(self._exchanges, lambda e: e[1][0] == e[1][1] == e[0])

    def _exchanges(self) -> tuple[float, list[float]]:
        counts = {self.sample(m, "afd_exchange_seconds_count", role="ffn", stage="0") for m in self.ffn_metrics}
        ffn = counts.pop() if len(counts) == 1 else float("nan")
        ranks = [
            self.sample(self.metrics + r, "afd_exchange_seconds_count", role="attention", rank=str(r), stage="0")
            for r in range(DP)
        ]
        return ffn, ranks

    def engine_requests(self) -> list[float]:
        """Requests each DP engine finished (vLLM's own per-engine counter on the API server)."""
        code, text = scrape(self.http, "/metrics")
        assert code == 200, text
        return engine_requests(text, DP)


# CI runs shm (same host only, the connector `vllm serve` once broke), NIXL (its own distribution, the one
# place it serves `vllm serve`) and CAM (routed dispatch: the gate on Attention, whose FFN idles between steps
# with no control plane); zmq's DP world runs across two nodes with the same assertions
# (test_vllm_multinode.py's fan-in case) and p2p's under `vllm serve` with replicas (test_vllm_failover.py), so
# their single-host cases are -m slow (CI time)
@pytest.fixture(
    scope="module",
    params=[
        pytest.param("zmq", marks=pytest.mark.slow),
        pytest.param("p2p", marks=pytest.mark.slow),
        "shm",
        "nixl",
        pytest.param("CAMAsyncAFDConnector", id="cam"),
    ],
)
def dp(request, tmp_path_factory, serving_model, native_server):
    if request.param == "nixl" and (missing := nixl_missing()) is not None:
        pytest.skip(missing)
    d = DPDeployment(tmp_path_factory.mktemp(f"dp-{request.param[:4].lower()}"), serving_model, request.param)
    try:
        native_server.wait_healthy(START_S)
        d.attn.wait_healthy(START_S)
        yield d
    except BaseException:
        print(d.logs())
        raise
    finally:
        d.stop()


def test_both_ranks_serve_concurrent_requests_equal_to_native(dp, native_server):
    before = dp.engine_requests()
    requests = [(p, 4 + 2 * i) for i, p in enumerate(PROMPTS)]
    split = asyncio.run(complete_many(dp.attn, requests))
    native = asyncio.run(complete_many(native_server, requests))
    for s, n in zip(split, native, strict=True):
        assert_same(s, n)
    served = [a - b for a, b in zip(dp.engine_requests(), before, strict=True)]
    assert sum(served) == len(requests) and min(served) >= 1, served  # some requests landed on each rank
    ffn, ranks = dp.exchanges()
    # one FFN call per layer-step merges both ranks: the FFN counts what each rank counts, not their sum
    assert ranks[0] == ranks[1] == ffn > 0, (ffn, ranks)


def test_one_rank_idle_while_the_other_serves_and_an_idle_pause(dp, native_server):
    before = dp.engine_requests()
    assert_same(complete(dp.attn, PROMPTS[3], 12), complete(native_server, PROMPTS[3], 12))
    served = [a - b for a, b in zip(dp.engine_requests(), before, strict=True)]
    assert sorted(served) == [0, 1], served  # one rank served it, the other stepped idle (dummy batches)
    ffn, ranks = dp.exchanges()
    assert ranks[0] == ranks[1] == ffn, (ffn, ranks)
    time.sleep(TIMEOUT_S + 2)  # longer than the exchange deadline, with nothing to do on either rank
    assert_same(complete(dp.attn, PROMPTS[1], 6), complete(native_server, PROMPTS[1], 6))
    for f, mport in enumerate(dp.ffn_metrics):
        code, body = scrape(mport, "/readyz")
        assert code == 200, body
        batch = dp.sample(mport, "afd_ffn_batch_tokens_sum", role="ffn")
        calls = dp.sample(mport, "afd_ffn_batch_tokens_count", role="ffn")
        print(f"{dp.connector}: FFN rank {f} batch fill {batch / calls:.2f} tokens per call over {calls:g} calls")
