"""Honest readiness: an idle side knows within ``timeout_s`` that the peer it depends on is gone.

The control plane's socket is *watched* (a thread counts its monitor's disconnects while nobody calls it),
so ``/readyz`` turns 503 naming the peer and its address with no request in flight, after a ``kill -9``
(the peer's TCP connection closes) and after ``SIGSTOP`` (ZMTP heartbeats stop and libzmq drops it).
Routed dispatch (CAM) has no control plane; its ranks beat through the world's store instead.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest
import zmq

from afd_sdk.control.endpoint import ZmqEndpoint
from afd_sdk.metrics import MetricsHub
from afd_sdk.runtime.ops_server import OpsServer
from afd_sdk.runtime.world import free_port_block

AFD = [sys.executable, "-m", "afd_sdk.cli"]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _until(probe, within_s: float, what: str):
    """Poll ``probe()`` until it returns a true value; fail naming ``what`` after ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"{what} not within {within_s:g}s")


def test_a_watched_endpoint_notices_a_peer_that_closed_while_nobody_calls_it():
    ctx = zmq.Context()
    port = free_port_block(1)
    server = ZmqEndpoint(ctx, "bind", f"tcp://127.0.0.1:{port}", timeout_s=2.0, watch=True)
    client = ZmqEndpoint(ctx, "connect", f"tcp://127.0.0.1:{port}", timeout_s=2.0, identity=b"a0", watch=True)
    try:
        client.sock.send(b"hello")
        server.wait(time.monotonic() + 5.0, "hello")
        assert server.sock.recv_multipart() == [b"a0", b"hello"]
        assert server.lost_for() is None and client.lost_for() is None
        client.close(linger_ms=0)
        lost = _until(server.lost_for, 5.0, "the binding side's watch seeing the drop")
        assert lost >= 0.0
        assert server.lost_for(tolerated_disconnects=1) is None  # a peer that said goodbye is not lost
    finally:
        client.close()
        server.close()
        ctx.term()  # returns: the watching threads closed their monitor sockets


_FROZEN_PEER = textwrap.dedent(
    """
    import sys, time, zmq
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, b"a0")
    s.connect(sys.argv[1])
    s.send(b"hello")
    print("sent", flush=True)
    time.sleep(120)
    """
)


def test_a_watched_endpoint_drops_a_frozen_peer_by_heartbeat():
    """SIGSTOP leaves the TCP connection open: only the heartbeat timeout (3 × timeout_s/6) can tell."""
    ctx = zmq.Context()
    port = free_port_block(1)
    timeout_s = 1.2
    server = ZmqEndpoint(ctx, "bind", f"tcp://127.0.0.1:{port}", timeout_s=timeout_s, watch=True)
    peer = subprocess.Popen([sys.executable, "-c", _FROZEN_PEER, f"tcp://127.0.0.1:{port}"], stdout=subprocess.PIPE)
    try:
        server.wait(time.monotonic() + 30.0, "hello")
        assert server.sock.recv_multipart() == [b"a0", b"hello"]
        time.sleep(2 * timeout_s)
        assert server.lost_for() is None  # alive and idle: heartbeats answered, not lost
        peer.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        _until(server.lost_for, timeout_s + 2.0, "the drop of a frozen peer")
        assert time.monotonic() - frozen <= timeout_s + 2.0
    finally:
        peer.kill()
        peer.wait(10)
        server.close()
        ctx.term()


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    pytest.importorskip("transformers", reason="the runtime needs the [hf] extra")
    from afd_sdk.integrations.transformers import save_tiny_checkpoint

    return save_tiny_checkpoint("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("qwen"))


#: routed dispatch has no control plane: its liveness is the heartbeats through the world's store
CAM = {"connector": "CAMAsyncAFDConnector", "compute_gate_on_attention": True}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("connector", "fault"),
    [
        ({"connector": "zmq"}, signal.SIGKILL),
        # the heartbeat path is the frozen-peer endpoint test's above; this end-to-end case adds no code path
        pytest.param({"connector": "zmq"}, signal.SIGSTOP, marks=pytest.mark.slow),
        (CAM, signal.SIGSTOP),  # a frozen FFN keeps its connections: only the heartbeats tell
    ],
    ids=["zmq-kill", "zmq-stop", "cam-stop"],
)
def test_an_idle_attention_rank_turns_unready_when_its_ffn_is_gone(qwen_dir, connector, fault):
    """`afd ffn serve` and an attention rank that handshakes and then idles; the FFN is killed or frozen."""
    from afd_sdk.runtime.session import open_role

    port, mport = free_port_block(4), free_port_block(1)
    timeout_s = 3.0
    cfg = {**connector, "host": "127.0.0.1", "port": port, "timeout_s": timeout_s}
    ffn = subprocess.Popen(
        [*AFD, "ffn", "serve", "--model", str(qwen_dir), "--config", json.dumps(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    hub = MetricsHub()
    ops = OpsServer("127.0.0.1", mport, hub)
    session = open_role({"afd": {**cfg, "role": "attention"}}, qwen_dir)
    url = f"http://127.0.0.1:{mport}/readyz"
    try:
        rec = hub.for_connector(session.connector)
        session.connector.init()
        rec.set_peer_state("connected")
        code, body = _get(url)
        assert code == 200 and json.loads(body)["worlds"][0]["peers"] == "connected", body
        time.sleep(timeout_s)  # idle for a whole deadline: heartbeats keep it ready
        assert _get(url)[0] == 200
        assert ffn.poll() is None, ffn.communicate()[1]  # and the FFN server waits out the idle world too
        ffn.send_signal(fault)
        gone = time.monotonic()
        code, body = _until(lambda: (r := _get(url))[0] == 503 and r, timeout_s + 2.0, "/readyz turning 503")
        assert time.monotonic() - gone <= timeout_s + 2.0
        world = json.loads(body)["worlds"][0]
        assert world["peers"] == "lost"
        assert world["lost"][0]["peer"] == "ffn rank 0"
        assert world["lost"][0]["address"] == f"tcp://127.0.0.1:{port}"
        # the metric says it too, without a step having failed
        assert rec.current_state()[0] == "lost" and rec.peer_state == "connected"
    finally:
        session.connector.close()
        ops.close()
        if ffn.poll() is None:
            ffn.kill()
        ffn.wait(30)
