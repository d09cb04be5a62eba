"""Scraping a process's ``/metrics`` endpoint in the runtime's multi-process tests, as Prometheus would."""

from __future__ import annotations

import urllib.request

__all__ = ["metric_sum", "metrics_text"]


def metrics_text(port: int, timeout_s: float = 2.0) -> str | None:
    """The text of ``127.0.0.1:port/metrics``; ``None`` when the scrape fails (nothing listens yet or any more,
    or the process is frozen past ``timeout_s``)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as r:
            return r.read().decode()
    except OSError:
        return None


def metric_sum(port: int, name: str) -> float:
    """The sum of ``name``'s labelled samples on the endpoint at ``port`` (0 when the scrape fails)."""
    text = metrics_text(port)
    if text is None:
        return 0.0
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))
