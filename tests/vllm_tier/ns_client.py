"""The tier's HTTP client inside a network namespace, for servers that listen only on a namespace's address.

Run as ``ip netns exec <ns> python ns_client.py``: one JSON request per line on stdin, one JSON answer per
line on stdout (``{"id": ..., "ok": result}`` or ``{"id": ..., "error": "..."}``, the request's ``id``).
Operations:

* ``{"op": "get", "url": ...}`` -> ``[status, body]``;
* ``{"op": "complete_many", "url": ..., "model": ..., "requests": [[prompt, max_tokens], ...]}`` -> one
  :func:`serve_client.choice` per request, sent concurrently (greedy, ``logprobs=1``).

:class:`NamespaceClient` is the test side: it starts the process and calls it with a deadline per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def get(url: str) -> list[Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return [r.status, r.read().decode()]
    except urllib.error.HTTPError as exc:
        return [exc.code, exc.read().decode()]
    except (urllib.error.URLError, OSError) as exc:
        return [0, str(exc)]


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        out: dict[str, Any]
        try:
            if req["op"] == "get":
                out = {"ok": get(req["url"])}
            elif req["op"] == "complete_many":
                from serve_client import complete_many_at

                out = {"ok": asyncio.run(complete_many_at(req["url"], req["model"], req["requests"]))}
            else:
                out = {"error": f"unknown op {req['op']!r}; expected 'get' or 'complete_many'"}
        except Exception as exc:  # answered to the test, which fails with it
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({"id": req["id"], **out}), flush=True)


class NamespaceClient:
    """This file's :func:`main` running inside namespace ``ns``; :meth:`call` waits at most ``timeout_s``."""

    def __init__(self, ns: str) -> None:
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=HERE,
        )
        self._answers: queue.Queue[str] = queue.Queue()
        self._next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self._answers.put(line)

    def call(self, timeout_s: float, **request: Any) -> Any:
        self._next_id += 1
        self.proc.stdin.write(json.dumps({"id": self._next_id, **request}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout_s
        while True:  # skips the late answer of an earlier call that timed out, and any line that is not ours
            try:
                line = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no answer to {request['op']} within {timeout_s:g}s") from None
            with contextlib.suppress(ValueError):
                answer = json.loads(line)
                if isinstance(answer, dict) and answer.get("id") == self._next_id:
                    break
        if "error" in answer:
            raise AssertionError(f"{request['op']} in the namespace failed: {answer['error']}")
        return answer["ok"]

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
