"""The operator's endpoint of one AFD process: ``/metrics``, ``/healthz``, ``/readyz`` over HTTP.

Started by ``afd ffn serve`` and ``afd attention generate`` when
``afd.metrics_port`` (or ``--metrics-port``) is set; off by default. It binds
one address, never a wildcard unless asked: ``afd.metrics_host`` where
given, else the address this process uses for AFD traffic: the local
address that routes to ``afd.host`` (``afd.host`` itself where it is local).

- ``/metrics``: Prometheus text format, :func:`afd_sdk.metrics.registry`.
- ``/healthz``: 200 while the process serves HTTP (a liveness probe: a dead or
  wedged process does not answer).
- ``/readyz``: 200 once every world's peers completed their handshake and none
  has ended or dropped; 503 before and after, with each world's state in the
  body and, for a world whose peer's connection dropped (also while idle: the
  control plane's heartbeats notice it), the peer, its address and since when;
  503 too once a drain was requested.
- ``POST /drain?op=<id>`` (FFN servers): serve the step in progress, say goodbye
  to the attention peers and exit 0 (:mod:`afd_sdk.runtime.drain`).
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

from afd_sdk.config import AFDConfig
from afd_sdk.errors import AFDConfigError
from afd_sdk.metrics import MetricsHub, registry
from afd_sdk.runtime.drain import Drain

logger = logging.getLogger(__name__)

__all__ = ["OpsServer", "metrics_address", "start_ops_server"]


def metrics_address(config: AFDConfig) -> tuple[str, int] | None:
    """Where ``config`` asks the endpoint to listen, or ``None`` when metrics are off."""
    if config.metrics_port is None:
        return None
    if config.metrics_host is not None:
        return config.metrics_host, config.metrics_port
    from afd_sdk.control.process_groups import route_source

    return route_source(config.host, config.port, config.connect_timeout_s), config.metrics_port


class OpsServer:
    """A threaded HTTP server for one hub; :meth:`close` stops it and releases the port."""

    def __init__(self, host: str, port: int, hub: MetricsHub, drain: Drain | None = None) -> None:
        self.hub = hub
        self.drain = drain
        reg = registry(hub)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

                    self._reply(200, generate_latest(reg), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._reply(200, b"alive\n", "text/plain; charset=utf-8")
                elif path == "/readyz":
                    worlds = server.worlds()  # one reading of each world: the verdict and the body agree
                    ready = bool(worlds) and all(w["peers"] == "connected" for w in worlds)
                    state: dict[str, Any] = {"ready": ready, "worlds": worlds}
                    if server.drain is not None and server.drain.requested:  # leaving: route nothing new here
                        state.update(ready=False, drain=server.drain.state())
                    body = json.dumps(state).encode() + b"\n"
                    self._reply(200 if state["ready"] else 503, body, "application/json")
                else:
                    self._reply(404, b"not found; try /metrics, /healthz, /readyz\n", "text/plain; charset=utf-8")

            def do_POST(self) -> None:
                path, _, query = self.path.partition("?")
                if path != "/drain" or server.drain is None:
                    what = "POST /drain on an FFN server" if server.drain is None else "POST /drain?op=<id>"
                    self._reply(404, f"not found; try {what}\n".encode(), "text/plain; charset=utf-8")
                    return
                op = parse_qs(query).get("op", [None])[0]
                code, answer = server.drain.request(op)
                self._reply(code, json.dumps(answer).encode() + b"\n", "application/json")

            def _reply(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: debug only
                logger.debug("ops endpoint: " + format, *args)

        try:
            self._http = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise AFDConfigError(
                f"afd.metrics_port={port} cannot be bound on {host!r}: {exc.strerror or exc}; expected a free port "
                "on an address of this host (afd.metrics_host)",
                key="afd.metrics_port",
                value=port,
            ) from None
        self._http.daemon_threads = True
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.2}, name="afd-ops-endpoint", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._http.server_address[:2]
        return str(host), int(port)

    def worlds(self) -> list[dict[str, Any]]:
        out = []
        for r in self.hub.recorders():
            state, lost = r.current_state()
            world: dict[str, Any] = {
                "port": r.port,
                "connector": r.connector,
                "role": r.role,
                "rank": r.rank,
                "peers": state,
            }
            if lost:
                world["lost"] = [
                    {"peer": p.peer, "address": p.address, "lost_for_s": round(p.lost_for_s, 3)} for p in lost
                ]
            out.append(world)
        return out

    def close(self) -> None:
        """Stop serving (returns within the poll interval) and close the listening socket."""
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> OpsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_ops_server(config: AFDConfig, hub: MetricsHub, drain: Drain | None = None) -> OpsServer | None:
    """The endpoint ``config`` asks for (``afd.metrics_port``), started; ``None`` when metrics are off.

    With ``drain`` (FFN servers) it also answers ``POST /drain?op=<id>`` (:mod:`afd_sdk.runtime.drain`).
    """
    where = metrics_address(config)
    if where is None:
        return None
    return OpsServer(where[0], where[1], hub, drain)
