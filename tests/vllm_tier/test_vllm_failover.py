"""FFN faults under ``vllm serve``: an FFN process is killed while eight requests stream; none fails.

Per case, one deployment of real processes on the serving tests' tiny Qwen3-MoE (the reference is the session's
native single engine, conftest.py):

* ``p2p`` — ``vllm serve`` as attention rank 0 with ``afd.ffn_replicas=2``, and ``afd ffn serve --engine vllm
  --replica 0`` / ``--replica 1``; replica 0 (in use) is killed;
* ``cam`` — routed dispatch (gate on Attention) over two FFN ranks with ``expert_replicas=2`` (each holds every
  expert, the primary of half), ``afd ffn serve --engine vllm --rank 0`` / ``--rank 1``; FFN rank 1 is killed and
  its experts' rows go to FFN rank 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed here; run the tier with scripts/bootstrap-vllm.sh (tests/vllm_tier)"
)
openai = pytest.importorskip("openai", reason="the OpenAI client comes with the vLLM tier (constraints/vllm-tier.txt)")

from serve_client import PROMPTS, aclient, afd_sample, scrape  # noqa: E402
from serve_processes import BIN, ENGINE, Server  # noqa: E402

from afd_sdk.integrations.vllm.serve import serve_argv  # noqa: E402
from afd_sdk.runtime.world import free_port_block  # noqa: E402

pytestmark = pytest.mark.timeout(900)

TIMEOUT_S = 5.0
START_S = 300.0
MAX_TOKENS = 24
#: p2p: its replicas are separate process groups (a new group per failover), the hardest case of the three
#: point-to-point connectors; zmq and shm fail over over the same wrapper in tests/test_failover.py. CAM: FFN ranks
#: are not interchangeable, each expert lives on two of them
CASES = {
    "p2p": ({"connector": "p2p", "ffn_replicas": 2}, "--replica"),
    "cam": (
        {
            "connector": "CAMAsyncAFDConnector",
            "compute_gate_on_attention": True,
            "num_ffn_ranks": 2,
            "connector_extra_config": {"expert_replicas": 2},
        },
        "--rank",
    ),
}


class FailoverDeployment:
    def __init__(self, tmp, model: str, case: str) -> None:
        self.tmp, self.case = tmp, case
        self.http, self.metrics = free_port_block(1), free_port_block(1)
        self.afd_port = free_port_block(64)
        keys, flag = CASES[case]
        afd = {**keys, "host": "127.0.0.1", "port": self.afd_port, "timeout_s": TIMEOUT_S}
        argv = serve_argv(
            model, {**afd, "metrics_port": self.metrics}, port=self.http, executable=str(BIN / "vllm"), **ENGINE
        )
        self.servers: list[Server] = []
        try:
            ffn_argv = [str(BIN / "afd"), "ffn", "serve", "--engine", "vllm", "--model", model]
            ffn_argv += ["--config", json.dumps(afd)]
            self.ffn = [self._start(f"ffn-{case}{k}", [*ffn_argv, flag, str(k)]) for k in range(2)]
            self.attn = self._start(f"attn-{case}", argv, http=self.http)
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, argv: list[str], http: int | None = None) -> Server:
        server = Server(name, argv, self.tmp, http_port=http)
        self.servers.append(server)
        return server

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def sample(self, name: str, **labels: str) -> float:
        return afd_sample(self.metrics, name, port=str(self.afd_port), role="attention", **labels)


@pytest.fixture(scope="module", params=list(CASES))
def replicated(request, tmp_path_factory, serving_model, native_server):
    d = FailoverDeployment(tmp_path_factory.mktemp(f"failover-{request.param}"), serving_model, request.param)
    try:
        native_server.wait_healthy(START_S)
        d.attn.wait_healthy(START_S)
        yield d
    except BaseException:
        print(*(s.log() for s in d.servers), sep="\n")
        raise
    finally:
        d.stop()


async def _stream_many(server: Server, prompts: list[str]) -> list[dict]:
    c = aclient(server)
    model = server.argv[2]

    async def one(prompt: str) -> dict:
        stream = await c.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        parts, reason = [], None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
        return {"text": "".join(parts), "finish_reason": reason}

    try:
        return list(await asyncio.gather(*(one(p) for p in prompts)))
    finally:
        await c.close()


def test_a_killed_replica_under_eight_streams_fails_no_request(replicated, native_server):
    d = replicated
    results: list[dict] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.extend(asyncio.run(_stream_many(d.attn, PROMPTS)))
        except BaseException as exc:  # reported by the assertion below, with the servers' logs
            errors.append(exc)

    before = d.sample("afd_steps_total")
    streams = threading.Thread(target=run)
    streams.start()
    deadline = time.monotonic() + 120
    while d.sample("afd_steps_total") < before + 4:  # the streams are under way on replica 0
        assert time.monotonic() < deadline and streams.is_alive(), (errors, d.attn.log()[-4000:])
        time.sleep(0.05)
    victim = 0 if d.case == "p2p" else 1  # the replica in use; CAM: FFN rank 1, whose experts rank 0 holds too
    d.ffn[victim].signal(signal.SIGKILL)
    streams.join(300)
    assert not streams.is_alive() and not errors, (errors, d.attn.log()[-4000:])
    native = asyncio.run(_stream_many(native_server, PROMPTS))
    assert results == native  # every request finished, with native's text
    log = d.attn.log(200000)
    assert d.sample("afd_failovers_total") == 1
    if d.case == "p2p":
        assert "now served by replica 1 (failover 1," in log, log[-4000:]
        assert d.sample("afd_ffn_replica") == 1
        assert d.sample("afd_failover_stall_seconds_count") == 1
    else:  # killed mid-exchange (re-dispatched: one stall) or between exchanges (routed around at the next one)
        assert "ffn rank 1 lost" in log, log[-4000:]
        assert d.sample("afd_failover_stall_seconds_count") <= 1
    code, body = scrape(d.metrics, "/readyz")
    assert code == 200 and json.loads(body)["worlds"][0]["peers"] == "connected", body
    assert d.attn.healthy()
