"""The OpenAI client side of the serving tests: requests, the equality check, and metrics scrapes."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TypeVar

import openai
from serve_processes import Server

T = TypeVar("T")
LOGPROB_TOLERANCE = 1e-4
PROMPTS = [
    "hello world",
    "the cat sat on the mat .",
    "one two three",
    "a big red dog and a small blue bird run fast in the sun",
    "model",
    "the sea and the sky are blue , the tree is green",
    "expert token layer attention ffn split",
    "good new old moon star",
]


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


def aclient(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


def choice(c) -> dict:
    lp = c.logprobs
    return {
        "text": c.text,
        "finish_reason": c.finish_reason,
        "tokens": list(lp.tokens) if lp else None,
        "logprobs": list(lp.token_logprobs) if lp else None,
    }


def complete(server: Server, prompt: str, max_tokens: int, **kw) -> dict:
    model = server.argv[2]
    r = client(server).completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1, **kw
    )
    return choice(r.choices[0])


async def complete_many(server: Server, requests: list[tuple[str, int]]) -> list[dict]:
    return await complete_many_at(server.url, server.argv[2], requests)


async def complete_many_at(url: str, model: str, requests: list[tuple[str, int]]) -> list[dict]:
    """Greedy completions of ``requests`` (prompt, max tokens), sent concurrently to the server at ``url``."""
    c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)

    async def one(prompt: str, max_tokens: int) -> dict:
        r = await c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1)
        return choice(r.choices[0])

    try:
        return list(await asyncio.gather(*(one(p, n) for p, n in requests)))
    finally:
        await c.close()


def assert_same(split: dict, native: dict) -> None:
    assert split["text"] == native["text"] and split["finish_reason"] == native["finish_reason"], (split, native)
    if native["tokens"] is not None:
        assert split["tokens"] == native["tokens"]
        diff = max((abs(a - b) for a, b in zip(split["logprobs"], native["logprobs"], strict=True)), default=0.0)
        assert diff <= LOGPROB_TOLERANCE, (diff, split, native)


def settled(read: Callable[[], T], holds: Callable[[T], bool], timeout_s: float = 30.0) -> T:
    """``read()`` once two reads 0.5 s apart agree and ``holds`` of it; after ``timeout_s``, the last read.

    After its last request a DP group keeps stepping idle ranks until vLLM's DP state sync finds every rank
    idle, so counters read one after the other may be caught between two steps: a test waits for its
    invariant to hold on a still group, and asserts it on what this returns (a broken invariant never holds).
    """
    deadline = time.monotonic() + timeout_s
    last = read()
    while True:
        time.sleep(0.5)
        now = read()
        if (now == last and holds(now)) or time.monotonic() >= deadline:
            return now
        last = now


def scrape(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def afd_sample(endpoint: int, name: str, /, **labels: str) -> float:
    """The one sample of ``name`` with ``labels`` on the AFD metrics endpoint at port ``endpoint``."""
    code, text = scrape(endpoint, "/metrics")
    assert code == 200, text
    return sample_of(text, name, **labels)


def engine_requests(text: str, engines: int) -> list[float]:
    """Requests each of ``engines`` DP engines finished: vLLM's per-engine counter in its API server's ``text``."""
    from prometheus_client.parser import text_string_to_metric_families

    per = [0.0] * engines
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:request_success_total":
                per[int(s.labels["engine"])] += s.value
    return per


def sample_sum(text: str, name: str, /) -> float:
    """The sum of every sample of ``name`` in a Prometheus exposition ``text`` (0 when there is none)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def sample_of(text: str, name: str, /, **labels: str) -> float:
    """The one sample of ``name`` with ``labels`` in a Prometheus exposition ``text``."""
    from prometheus_client.parser import text_string_to_metric_families

    found = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]
