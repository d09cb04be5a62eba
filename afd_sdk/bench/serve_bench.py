"""``afd bench serve``: native and AFD ``vllm serve`` deployments in turn, driven by vLLM's own load client.

Every deployment serves the same checkpoint with the same engine flags and takes the same load from
``vllm bench serve`` (random data, ``--ignore-eos``); nothing else runs meanwhile. Setups:

* ``one-engine`` — one AFD attention engine and one FFN server, against one native engine;
* ``dp2`` — ``vllm serve --data-parallel-size 2`` as one AFD world (one FFN server merges both ranks), against
  one native engine (native DP with an MoE does not run on vLLM's CPU communicator);
* ``two-worlds`` — two AFD attention engines, each its own world, one FFN server for both
  (``--world-port``), against two native engines; the load is split in half between two clients.

Each result has output tokens/s, TTFT and TPOT p50/p99 (computed from the client's per-request records the
way ``vllm bench serve`` does, so the two-client setups merge exactly), the AFD/native ratios, and from AFD's
own metrics the FFN batch fill (tokens per FFN call) and where a layer's exchange time goes: the FFN's compute
and the rest (transfer, the wait for the other ranks, the proxies' work).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afd_sdk.errors import AFDConfigError, AFDError

__all__ = ["SETUPS", "ServeBenchError", "ServeBenchOptions", "client_metrics", "run_serve_bench"]

SETUPS = ("one-engine", "dp2", "two-worlds")
START_S = 600.0
Progress = Callable[[str], None]


class ServeBenchError(AFDError):
    """A deployment or the load client failed during ``afd bench serve`` (the message carries its log)."""


@dataclass(frozen=True)
class ServeBenchOptions:
    connectors: Sequence[str] = ("zmq",)
    setups: Sequence[str] = SETUPS
    arch: str = "Qwen3MoeForCausalLM"
    model: str | None = None  # None: a seeded tiny serving checkpoint under work_dir
    num_prompts: int = 32
    max_concurrency: int = 8
    input_len: int = 24
    output_len: int = 24
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    timeout_s: float = 60.0
    #: rounds of every deployment in turns (native first each round); rows report the median round
    repeats: int = 1
    #: connector name -> its ``connector_extra_config`` in every AFD deployment of that connector
    extra_configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    work_dir: Path = field(default_factory=lambda: Path("afd-bench-serve"))


def _percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default, which ``vllm bench serve`` uses)."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def client_metrics(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Output tok/s, TTFT and TPOT p50/p99 (ms) over one or more ``vllm bench serve --save-detailed`` results.

    TPOT of a request is ``(latency - ttft) / (output tokens - 1)`` (requests of one token have none), as
    ``vllm bench serve`` computes it; percentiles are over every client's requests. Throughput is each
    client's tokens over its own window (first start to last end), summed; ``overlap`` is the share of the
    clients' common window in their union, how far the sum is one concurrent load.
    """
    ttfts: list[float] = []
    tpots: list[float] = []
    windows: list[tuple[float, float]] = []
    tokens = completed = failed = 0
    rate = 0.0
    for r in records:
        starts: list[float] = []
        ends: list[float] = []
        client_tokens = 0
        for i, latency in enumerate(r["latencies"]):
            if r["errors"][i]:
                failed += 1
                continue
            completed += 1
            out = int(r["output_lens"][i])
            client_tokens += out
            ttfts.append(float(r["ttfts"][i]))
            if out > 1:
                tpots.append((float(latency) - float(r["ttfts"][i])) / (out - 1))
            starts.append(float(r["start_times"][i]))
            ends.append(float(r["start_times"][i]) + float(latency))
        if ends:
            windows.append((min(starts), max(ends)))
            rate += client_tokens / (windows[-1][1] - windows[-1][0])
        tokens += client_tokens
    union = (max(e for _, e in windows) - min(s for s, _ in windows)) if windows else 0.0
    common = (min(e for _, e in windows) - max(s for s, _ in windows)) if windows else 0.0
    return {
        "completed": completed,
        "failed": failed,
        "output_tokens": tokens,
        "duration_s": union,
        # each client over its own window, summed: the clients are separate processes that start their load
        # seconds apart; `overlap` says how much of the union their windows share (1.0 for one client)
        "output_tok_s": rate,
        "overlap": max(0.0, common) / union if union > 0 else 0.0,
        "ttft_ms": {"p50": 1000 * _percentile(ttfts, 50), "p99": 1000 * _percentile(ttfts, 99)},
        "tpot_ms": {"p50": 1000 * _percentile(tpots, 50), "p99": 1000 * _percentile(tpots, 99)},
    }


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the AFD metrics endpoint at ``port``, by (name, sorted labels)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _total(samples: Mapping[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def afd_breakdown(
    ffn_before: Mapping, ffn_after: Mapping, attn_before: Sequence[Mapping], attn_after: Sequence[Mapping]
) -> dict[str, float]:
    """FFN batch fill and a layer exchange's time split, from metrics scraped before and after the load."""

    def delta(before: Mapping, after: Mapping, name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    calls = delta(ffn_before, ffn_after, "afd_ffn_batch_tokens_count", role="ffn")
    batch_tokens = delta(ffn_before, ffn_after, "afd_ffn_batch_tokens_sum", role="ffn")
    compute_s = delta(ffn_before, ffn_after, "afd_ffn_compute_seconds_sum", role="ffn")
    pairs = list(zip(attn_before, attn_after, strict=True))
    exchanges = sum(delta(b, a, "afd_exchange_seconds_count", role="attention") for b, a in pairs)
    exchange_s = sum(delta(b, a, "afd_exchange_seconds_sum", role="attention") for b, a in pairs)
    per_exchange_us = 1e6 * exchange_s / exchanges if exchanges else 0.0
    compute_us = 1e6 * compute_s / calls if calls else 0.0
    return {
        "ffn_calls": calls,
        "ffn_batch_tokens_mean": batch_tokens / calls if calls else 0.0,
        "attention_exchanges": exchanges,
        "exchange_us_mean": per_exchange_us,
        "ffn_compute_us_mean": compute_us,
        "exchange_other_us_mean": per_exchange_us - compute_us,
    }


class _Bench:
    """The processes of one deployment at a time, with their ports and the load client."""

    def __init__(self, opts: ServeBenchOptions, progress: Progress) -> None:
        from afd_sdk.integrations.vllm.demo import WORLD_ENV

        self.opts = opts
        self.progress = progress
        self.bin = Path(sys.executable).parent
        self.env = {
            **WORLD_ENV,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "VLLM_PLUGINS": "afd",
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        self.opts.work_dir.mkdir(parents=True, exist_ok=True)
        self.model = opts.model or self._checkpoint()
        self.engine = {
            "max_model_len": opts.input_len + opts.output_len + 16,
            "max_num_seqs": opts.max_num_seqs,
            "max_num_batched_tokens": opts.max_num_batched_tokens,
            "seed": 0,
        }

    def _checkpoint(self) -> str:
        from afd_sdk.integrations.vllm.serve import save_serving_checkpoint

        out = self.opts.work_dir / f"model-{self.opts.arch}"
        if not (out / "config.json").exists():
            save_serving_checkpoint(self.opts.arch, out)
        return str(out)

    def _server(self, name: str, argv: list[str], http: int | None, health: str = "/health"):
        from afd_sdk.integrations.vllm.server_process import ServerProcess

        return ServerProcess(name, argv, self.opts.work_dir, http_port=http, env=self.env, health_path=health)

    def _serve_argv(self, http: int, afd: Mapping[str, Any] | None, **extra: Any) -> list[str]:
        from afd_sdk.integrations.vllm.serve import serve_argv

        return serve_argv(self.model, afd, port=http, executable=str(self.bin / "vllm"), **self.engine, **extra)

    def _client(self, name: str, http: int, prompts: int, concurrency: int) -> dict[str, Any]:
        import subprocess

        out = self.opts.work_dir / f"{name}.json"
        argv = [str(self.bin / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{http}"]
        argv += ["--model", self.model, "--tokenizer", self.model, "--dataset-name", "random"]
        argv += ["--random-input-len", str(self.opts.input_len), "--random-output-len", str(self.opts.output_len)]
        argv += ["--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos"]
        argv += ["--seed", "0", "--disable-tqdm", "--save-result", "--save-detailed"]
        argv += ["--result-dir", str(out.parent), "--result-filename", out.name]
        log = self.opts.work_dir / f"{name}.client.log"
        with log.open("w") as fh:
            rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=self.env, timeout=1800).returncode
        if rc != 0:
            raise ServeBenchError(f"vllm bench serve against {name} exited {rc}:\n{log.read_text()[-3000:]}")
        return json.loads(out.read_text())

    def _drive(self, name: str, https: Sequence[int]) -> dict[str, Any]:
        """The load against ``https`` (split evenly when several), as one merged measurement."""
        n = len(https)
        self.progress(f"{name}: {self.opts.num_prompts} prompts, concurrency {self.opts.max_concurrency}")
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futures = [
                pool.submit(
                    self._client, f"{name}-{i}", h, self.opts.num_prompts // n, max(1, self.opts.max_concurrency // n)
                )
                for i, h in enumerate(https)
            ]
            records = [f.result() for f in futures]
        return client_metrics(records)

    def native(self, engines: int) -> dict[str, Any]:
        from afd_sdk.runtime.world import free_port_block

        http = free_port_block(engines)
        with contextlib.ExitStack() as running:  # every server started is stopped, whatever fails next
            servers = [
                running.enter_context(self._server(f"native{engines}-{i}", self._serve_argv(http + i, None), http + i))
                for i in range(engines)
            ]
            for s in servers:
                s.wait_healthy(START_S)
            return self._drive(f"native-x{engines}", [http + i for i in range(engines)])

    def afd(self, connector: str, setup: str) -> dict[str, Any]:
        from afd_sdk.runtime.world import free_port_block

        ranks = 2 if setup == "dp2" else 1
        worlds = _engines(setup)
        http = free_port_block(worlds)
        base = free_port_block(16 * worlds)
        ports = [base + 16 * w for w in range(worlds)]
        metrics = free_port_block(worlds * ranks + 1)
        ffn_metrics = metrics + worlds * ranks
        dp_rpc = free_port_block(worlds)
        # a dead peer fails the run within the exchange deadline, and a peer that never comes within START_S
        afd = {"connector": connector, "host": "127.0.0.1", "num_attention_ranks": ranks}
        afd.update(timeout_s=self.opts.timeout_s, connect_timeout_s=START_S)
        if connector in self.opts.extra_configs:
            afd["connector_extra_config"] = dict(self.opts.extra_configs[connector])
        ffn_argv = [str(self.bin / "afd"), "ffn", "serve", "--engine", "vllm", "--model", self.model]
        ffn_argv += ["--config", json.dumps({**afd, "port": ports[0]}), "--metrics-port", str(ffn_metrics)]
        if worlds > 1:
            ffn_argv += [a for p in ports for a in ("--world-port", str(p))]
        name = f"afd-{connector}-{setup}"
        with contextlib.ExitStack() as running:  # stopped in reverse: the attention engines first, then the FFN
            ffn = running.enter_context(self._server(f"{name}-ffn", ffn_argv, ffn_metrics, "/healthz"))
            attention = []
            for w in range(worlds):
                extra: dict[str, Any] = {}
                if ranks > 1:
                    extra = {"data_parallel_size": ranks, "data_parallel_address": "127.0.0.1", "api_server_count": 1}
                    extra["data_parallel_rpc_port"] = dp_rpc + w
                cfg = {**afd, "port": ports[w], "metrics_port": metrics + w * ranks}
                argv = self._serve_argv(http + w, cfg, **extra)
                attention.append(running.enter_context(self._server(f"{name}-attn{w}", argv, http + w)))
            ffn.wait_healthy(START_S)  # its endpoint answers from start-up on: the process is up
            for s in attention:
                s.wait_healthy(START_S)
            attn_metrics = [metrics + i for i in range(worlds * ranks)]
            before = (_scrape(ffn_metrics), [_scrape(p) for p in attn_metrics])
            result = self._drive(name, [http + w for w in range(worlds)])
            after = (_scrape(ffn_metrics), [_scrape(p) for p in attn_metrics])
            result["afd"] = afd_breakdown(before[0], after[0], before[1], after[1])
            return result


def _engines(setup: str) -> int:
    """Engines (and AFD worlds) a setup runs, and so the native deployment it is compared with."""
    return 2 if setup == "two-worlds" else 1


def _ratios(afd: Mapping[str, Any], native: Mapping[str, Any]) -> dict[str, float]:
    def ratio(a: float, b: float) -> float:
        return a / b if b else 0.0

    return {
        "output_tok_s": ratio(afd["output_tok_s"], native["output_tok_s"]),
        "ttft_p50": ratio(afd["ttft_ms"]["p50"], native["ttft_ms"]["p50"]),
        "tpot_p50": ratio(afd["tpot_ms"]["p50"], native["tpot_ms"]["p50"]),
        "tpot_p99": ratio(afd["tpot_ms"]["p99"], native["tpot_ms"]["p99"]),
    }


def validate_options(opts: ServeBenchOptions) -> None:
    """Before any process starts: every setup known, the load divisible between the setups' clients."""
    if not 1 <= opts.repeats <= 100:
        raise AFDConfigError(f"repeats={opts.repeats} is invalid; expected 1..100", key="repeats", value=opts.repeats)
    unknown = [s for s in opts.setups if s not in SETUPS]
    if unknown:
        raise AFDConfigError(
            f"setup {unknown[0]!r} is unknown; expected one of {', '.join(SETUPS)}", key="setups", value=unknown[0]
        )
    if "two-worlds" in opts.setups and (opts.num_prompts % 2 or opts.max_concurrency % 2):
        raise AFDConfigError(
            f"num_prompts={opts.num_prompts}, max_concurrency={opts.max_concurrency}: two-worlds splits the load "
            "between two clients; expected even numbers",
            key="num_prompts",
            value=opts.num_prompts,
        )
    from afd_sdk.plugins import get_plugin_manager

    for c in opts.connectors:
        get_plugin_manager().connector_class(c)  # ConnectorNotFoundError names the accepted ones
    for c, extra in opts.extra_configs.items():
        if c not in opts.connectors:
            raise AFDConfigError(
                f"connector_extra_config is given for {c!r}, which this run does not bench; "
                f"expected one of {', '.join(opts.connectors)}",
                key="connector_extra_config",
                value=c,
            )
        get_plugin_manager().connector_class(c).parse_extra_config(extra)  # unknown keys and bad values: here


def run_serve_bench(opts: ServeBenchOptions, progress: Progress | None = None) -> dict[str, Any]:
    """Every setup × connector, native first, ``repeats`` rounds in turns; returns the ``--json`` document.

    Each AFD run is compared with the native run of its own round, so a host whose speed drifts between
    rounds (a shared 2-core VM does, by 1.5× here) moves both sides of a ratio alike; a row reports its
    median round and every round's ratio.
    """
    validate_options(opts)
    say = progress or (lambda _m: None)
    bench = _Bench(opts, say)
    t0 = time.monotonic()
    runs: dict[tuple[str, str], list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for r in range(opts.repeats):
        tag = f" (round {r + 1}/{opts.repeats})" if opts.repeats > 1 else ""
        natives: dict[int, dict[str, Any]] = {}
        for setup in opts.setups:
            engines = _engines(setup)
            if engines not in natives:
                say(f"native x{engines}: starting{tag}")
                natives[engines] = bench.native(engines)
            for connector in opts.connectors:
                say(f"{connector} {setup}: starting{tag}")
                runs.setdefault((setup, connector), []).append((bench.afd(connector, setup), natives[engines]))
    rows = []
    for (setup, connector), pairs in runs.items():
        ratios = [_ratios(afd, native) for afd, native in pairs]
        order = sorted(range(len(pairs)), key=lambda i: ratios[i]["output_tok_s"])
        mid = order[(len(order) - 1) // 2]  # the median round (the lower one of an even count)
        rows.append(
            {
                "setup": setup,
                "connector": connector,
                "connector_extra_config": dict(opts.extra_configs.get(connector, {})),
                "native_engines": _engines(setup),
                "afd": pairs[mid][0],
                "native": pairs[mid][1],
                "ratio": ratios[mid],
                "round": mid,
                "round_ratios": [x["output_tok_s"] for x in ratios],
            }
        )
    return {
        "arch": opts.arch,
        "model": bench.model,
        "load": {
            "client": "vllm bench serve",
            "dataset": "random",
            "num_prompts": opts.num_prompts,
            "max_concurrency": opts.max_concurrency,
            "input_len": opts.input_len,
            "output_len": opts.output_len,
        },
        "engine": bench.engine,
        "repeats": opts.repeats,
        "rows": rows,
        "wall_s": time.monotonic() - t0,
    }


def plot(result: Mapping[str, Any], path: Path) -> Path:
    """A bar chart of AFD/native output throughput per setup and connector (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise AFDConfigError("--plot needs matplotlib (pip install matplotlib)", key="plot", value=str(path)) from exc
    rows = result["rows"]
    labels = [f"{r['setup']}\n{r['connector']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(rows)), 3.2))
    ax.bar(labels, [r["ratio"]["output_tok_s"] for r in rows])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("AFD / native output tok/s")
    ax.set_title(f"afd bench serve: {result['arch']}, {result['load']['num_prompts']} prompts")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
