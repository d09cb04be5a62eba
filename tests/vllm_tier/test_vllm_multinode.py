"""vLLM's data-parallel group across two nodes with vLLM's own multi-node flags, as one AFD world.

Two network namespaces joined by a veth pair stand in for two nodes (``netns.py``):

* node A: ``vllm serve --data-parallel-size 2 --data-parallel-size-local 1 --data-parallel-address <A>``, the
  API server and DP rank 0 (attention rank 0);
* node B: ``vllm serve --headless --data-parallel-start-rank 1 ...``, DP rank 1 (attention rank 1);
* the FFN pool: ``afd ffn serve --engine vllm --rank r`` on its node. In CI one FFN rank on node B fans the
  two attention ranks in (the pool serving ranks on both nodes); with ``-m slow`` two FFN ranks, rank 0 on
  node B and rank 1 on node A (``afd.ffn_hosts``).

Start order is free (node B's headless engine first, the FFN pool, node A last). Every process binds the
configured addresses; vLLM's DP group (Gloo) takes its interface from ``GLOO_SOCKET_IFNAME``, which each
node sets (docs/deploy.md says why). Requests come from a client inside node A (``ns_client.py``): nothing
is reachable from outside the namespaces. The reference is the session's native single engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed here; run the tier with scripts/bootstrap-vllm.sh (tests/vllm_tier)"
)
pytest.importorskip("openai", reason="the OpenAI client comes with the vLLM tier (constraints/vllm-tier.txt)")

from listening import is_wildcard, listening  # noqa: E402
from netns import NetnsUnavailable, namespace_pids, process_name, two_hosts  # noqa: E402
from ns_client import NamespaceClient  # noqa: E402
from serve_client import PROMPTS, assert_same, complete, complete_many, engine_requests, sample_of, settled  # noqa: E402
from serve_processes import BIN, ENGINE, Server  # noqa: E402

from afd_sdk.integrations.vllm.serve import serve_argv  # noqa: E402

pytestmark = pytest.mark.timeout(900)

TIMEOUT_S = 5.0
START_S = 300.0
DP = 2
HTTP, AFD_PORT, RPC, METRICS = 8000, 41000, 43000, 42000  # each node has its own port space


class Node:
    """One namespace as a node: its name, address and interface."""

    def __init__(self, ns: str, ip: str, dev: str) -> None:
        self.ns, self.ip, self.dev = ns, ip, dev

    def argv(self, argv: list[str]) -> list[str]:
        # `env` execs the command: the server's pid is the command's own, as with `ip netns exec`. The node's
        # environment is what docs/deploy.md gives (not the tier's loopback VLLM_HOST_IP)
        return ["ip", "netns", "exec", self.ns, "env", "-u", "VLLM_HOST_IP", f"GLOO_SOCKET_IFNAME={self.dev}", *argv]


class NodeServer(Server):
    """A tier server inside a node; ``/health`` is asked through the node's client."""

    def __init__(
        self, name: str, argv: list[str], log_dir, node: Node, client: NamespaceClient | None, http: int = HTTP
    ) -> None:
        super().__init__(name, node.argv(argv), log_dir)
        self.node, self.client, self.http = node, client, http

    def healthy(self) -> bool:
        assert self.client is not None
        return self.client.call(30, op="get", url=f"http://{self.node.ip}:{self.http}/health")[0] == 200


class NodeDeployment:
    """Servers on nodes, asked through a client inside node A; stopped together."""

    servers: list[NodeServer]
    client: NamespaceClient
    head: NodeServer

    def start_ffn_pool(self, tmp, model: str, afd: dict, nodes: list[Node], metrics_port: int) -> None:
        """``afd ffn serve --engine vllm --rank r`` on ``nodes[r]``, each with its endpoint on ``metrics_port``."""
        for r, node in enumerate(nodes):
            ffn = [str(BIN / "afd"), "ffn", "serve", "--engine", "vllm", "--model", model, "--rank", str(r)]
            ffn += ["--config", json.dumps(afd), "--metrics-port", str(metrics_port)]
            self.servers.append(NodeServer(f"ffn-{r}", ffn, tmp, node, None))

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        self.client.close()

    def logs(self) -> str:
        return "\n".join(f"--- {s.name}\n{s.log()}" for s in self.servers)


def serving(d: NodeDeployment, native_server: Server) -> Iterator[NodeDeployment]:
    """A module fixture's body: ``d`` once its API server and the native one answer; its logs if that fails."""
    try:
        native_server.wait_healthy(START_S)
        d.head.wait_healthy(START_S)
        yield d
    except BaseException:
        print(d.logs())
        raise
    finally:
        d.stop()


class MultiNode(NodeDeployment):
    """The deployment: node A (API server, DP rank 0), node B (headless DP rank 1), the FFN pool."""

    def __init__(self, tmp, model: str, a: Node, b: Node, ffn_nodes: list[Node]) -> None:
        self.a, self.b, self.ffn_nodes, self.model = a, b, ffn_nodes, model
        self.afd = {
            "connector": "zmq",
            "ffn_hosts": [n.ip for n in ffn_nodes],
            "num_ffn_ranks": len(ffn_nodes),
            "port": AFD_PORT,
            "num_attention_ranks": DP,
            "timeout_s": TIMEOUT_S,
        }
        common = {
            "executable": str(BIN / "vllm"),
            "data_parallel_size": DP,
            "data_parallel_size_local": 1,
            "data_parallel_address": a.ip,
            "data_parallel_rpc_port": RPC,
            **ENGINE,
        }
        attn = {**self.afd, "metrics_port": METRICS}  # each node's one engine: local DP rank 0
        head = serve_argv(model, attn, port=HTTP, host=a.ip, api_server_count=1, **common)
        headless = serve_argv(model, attn, port=HTTP, headless=True, data_parallel_start_rank=1, **common)
        self.client = NamespaceClient(a.ns)
        self.servers: list[NodeServer] = []
        try:
            self.servers.append(NodeServer("node-b-headless", headless, tmp, b, None))
            self.start_ffn_pool(tmp, model, self.afd, ffn_nodes, METRICS + 1)
            self.head = NodeServer("node-a", head, tmp, a, self.client)
            self.servers.append(self.head)
        except BaseException:
            self.stop()
            raise

    def metrics(self, node: Node, port: int) -> str:
        code, text = self.client.call(30, op="get", url=f"http://{node.ip}:{port}/metrics")
        assert code == 200, text
        return text

    def complete_many(self, requests: list[tuple[str, int]]) -> list[dict]:
        return self.client.call(
            300, op="complete_many", url=f"http://{self.a.ip}:{HTTP}", model=self.model, requests=requests
        )

    def engine_requests(self) -> list[float]:
        """Requests each DP engine finished (vLLM's per-engine counter on the API server)."""
        return engine_requests(self.metrics(self.a, HTTP), DP)

    def exchanges(self) -> tuple[list[float], list[float]]:
        """Each FFN rank's exchange count and each attention rank's, stage 0, once the group stopped stepping."""
        return settled(self._exchanges, lambda e: e[1][0] == e[1][1] and e[0] == [e[1][0]] * len(e[0]))

    def _exchanges(self) -> tuple[list[float], list[float]]:
        port = str(AFD_PORT)
        ffn = [
            sample_of(self.metrics(n, METRICS + 1), "afd_exchange_seconds_count", role="ffn", port=port, stage="0")
            for n in self.ffn_nodes
        ]
        ranks = [
            sample_of(
                self.metrics(n, METRICS),
                "afd_exchange_seconds_count",
                role="attention",
                rank=str(r),
                port=port,
                stage="0",
            )
            for r, n in enumerate((self.a, self.b))
        ]
        return ffn, ranks


@pytest.fixture(scope="module")
def nodes():
    try:
        with two_hosts("afm") as hosts:
            yield Node(hosts.attn_ns, hosts.attn_ip, hosts.attn_dev), Node(hosts.ffn_ns, hosts.ffn_ip, hosts.ffn_dev)
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))


#: "fan-in": one FFN rank on node B serves both nodes' attention ranks (CI); "pool": FFN rank r beside
#: attention rank 1 - r, so each FFN rank is on the other node from its attention rank (-m slow, CI time)
@pytest.fixture(scope="module", params=["fan-in", pytest.param("pool", marks=pytest.mark.slow)])
def deployment(request, nodes, tmp_path_factory, serving_model, native_server):
    a, b = nodes
    ffn_nodes = [b] if request.param == "fan-in" else [b, a]
    d = MultiNode(tmp_path_factory.mktemp(f"multinode-{request.param}"), serving_model, a, b, ffn_nodes)
    yield from serving(d, native_server)


def test_dp_group_across_nodes_equals_native_with_requests_on_both_nodes(deployment, native_server):
    d = deployment
    before = d.engine_requests()
    requests = [(p, 4 + 2 * i) for i, p in enumerate(PROMPTS)]
    split = d.complete_many(requests)
    native = asyncio.run(complete_many(native_server, requests))
    for s, n in zip(split, native, strict=True):
        assert_same(s, n)
    served = [x - y for x, y in zip(d.engine_requests(), before, strict=True)]
    assert sum(served) == len(requests) and min(served) >= 1, served  # each node's engine served some
    ffn, ranks = d.exchanges()
    assert ranks[0] == ranks[1] > 0, ranks
    # fan-in: one FFN call per layer-step merges both nodes' ranks; pool: each FFN rank serves one rank
    assert ffn == [ranks[0]] * len(ffn), (ffn, ranks)


def test_one_node_idle_and_an_idle_pause(deployment, native_server):
    d = deployment
    before = d.engine_requests()
    assert_same(d.complete_many([(PROMPTS[3], 12)])[0], complete(native_server, PROMPTS[3], 12))
    served = [x - y for x, y in zip(d.engine_requests(), before, strict=True)]
    assert sorted(served) == [0, 1], served  # one node's engine served it, the other stepped idle (dummy batches)
    time.sleep(TIMEOUT_S + 2)  # longer than the exchange deadline, with nothing to do on either node
    assert_same(d.complete_many([(PROMPTS[1], 6)])[0], complete(native_server, PROMPTS[1], 6))
    ffn, ranks = d.exchanges()
    assert ffn == [ranks[0]] * len(ffn) and ranks[0] == ranks[1], (ffn, ranks)
    for node in d.ffn_nodes:
        code, body = d.client.call(30, op="get", url=f"http://{node.ip}:{METRICS + 1}/readyz")
        assert code == 200, body


def test_every_socket_on_its_nodes_address(deployment, nodes):
    """AFD's sockets on the configured addresses; the only wildcard listeners are vLLM's own (docs/deploy.md)."""
    vllm_wildcard: list[tuple[str, str, int]] = []
    for node in nodes:
        for pid in namespace_pids(node.ns):
            name = process_name(pid)
            for addr, port in listening({pid}):
                if is_wildcard(addr):
                    # vLLM's torch.distributed TCPStore (its worker's world group): a TCPStore listens on
                    # every interface whatever address it is given
                    assert name.startswith("VLLM::"), (node.ns, name, addr, port)
                    vllm_wildcard.append((name, addr, port))
                else:
                    assert addr in ("127.0.0.1", node.ip), (node.ns, name, addr, port)
    print("vLLM's own wildcard listeners:", vllm_wildcard)
    afd = {(n.ip, AFD_PORT + r) for r, n in enumerate(deployment.ffn_nodes)}  # each FFN rank's control plane
    seen = {s for node in nodes for s in listening(namespace_pids(node.ns))}
    assert afd <= seen, (afd, seen)


# --- expert-sharded dispatch (CAM, gate on Attention) with FFN ranks on both nodes ------------------------------
#
# One attention engine on node A, whose CAM world holds FFN rank 0 on node B and FFN rank 1 beside it on node A.
# CAM's DP group (two attention ranks, the gate on Attention) runs on one host in test_vllm_serve_dp.py ("cam").


#: the routed deployment's own ports: pytest keeps the DP deployment above up until the module ends
R_HTTP, R_AFD_PORT, R_METRICS = HTTP + 1, AFD_PORT + 200, METRICS + 200


class RoutedAcrossNodes(NodeDeployment):
    """``vllm serve`` (gate on Attention) on node A; ``afd ffn serve --engine vllm --rank r`` on node B, node A."""

    def __init__(self, tmp, model: str, a: Node, b: Node) -> None:
        self.a, self.ffn_nodes, self.model = a, [b, a], model
        # CAM's world meets at attention rank 0's afd.host (it refuses ffn_hosts)
        afd = {
            "connector": "CAMAsyncAFDConnector",
            "compute_gate_on_attention": True,
            "host": a.ip,
            "port": R_AFD_PORT,
            "num_ffn_ranks": 2,
            "timeout_s": TIMEOUT_S,
        }
        head = serve_argv(
            model, {**afd, "metrics_port": R_METRICS}, port=R_HTTP, host=a.ip, executable=str(BIN / "vllm"), **ENGINE
        )
        self.client = NamespaceClient(a.ns)
        self.servers: list[NodeServer] = []
        try:
            self.start_ffn_pool(tmp, model, afd, self.ffn_nodes, R_METRICS + 1)
            self.head = NodeServer("node-a-routed", head, tmp, a, self.client, R_HTTP)
            self.servers.append(self.head)
        except BaseException:
            self.stop()
            raise

    def exchanges(self) -> list[float]:
        """Each FFN rank's exchange count (one per MoE layer-step it was dispatched to)."""
        out = []
        for n in self.ffn_nodes:
            code, text = self.client.call(30, op="get", url=f"http://{n.ip}:{R_METRICS + 1}/metrics")
            assert code == 200, text
            out.append(sample_of(text, "afd_exchange_seconds_count", role="ffn", port=str(R_AFD_PORT), stage="0"))
        return out


@pytest.fixture(scope="module")
def routed(nodes, tmp_path_factory, serving_model, native_server):
    a, b = nodes
    d = RoutedAcrossNodes(tmp_path_factory.mktemp("multinode-routed"), serving_model, a, b)
    yield from serving(d, native_server)


@pytest.mark.slow  # CI time: an engine and two FFN servers; the routed split itself runs in CI (test_vllm_engine.py)
def test_routed_dispatch_to_ffn_ranks_on_both_nodes_equals_native(routed, native_server):
    requests = [(p, 4 + 2 * i) for i, p in enumerate(PROMPTS)]
    split = routed.client.call(
        300, op="complete_many", url=f"http://{routed.a.ip}:{R_HTTP}", model=routed.model, requests=requests
    )
    native = asyncio.run(complete_many(native_server, requests))
    for s, n in zip(split, native, strict=True):
        assert_same(s, n)
    # every MoE layer of every step is dispatched to both FFN ranks, across the link and beside the engine
    b, a = routed.exchanges()
    assert b == a > 0, (b, a)
    for node in routed.ffn_nodes:
        code, body = routed.client.call(30, op="get", url=f"http://{node.ip}:{R_METRICS + 1}/readyz")
        assert code == 200, body
