"""Runtime commands: ``afd demo``, ``afd ffn serve``, ``afd attention generate``."""

from __future__ import annotations

import json
from typing import Any

import click

from afd_sdk.config import AFDConfig
from afd_sdk.errors import AFDConfigError

_METRICS_PORT = click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Serve /metrics (Prometheus), /healthz and /readyz on this port (sets afd.metrics_port; off by default).",
)


def _role_config(config: str, role: str, metrics_port: int | None = None) -> AFDConfig:
    """The command's ``AFDConfig``, parsed once from ``--config`` (and ``--metrics-port``); everything below
    takes it as is."""
    from afd_sdk.config import config_mapping, parse_config

    mapping = dict(config_mapping(config))
    if metrics_port is not None:
        mapping["metrics_port"] = metrics_port
    given = mapping.get("role", mapping.get("afd_role"))
    if given is None:
        mapping["role"] = role
    elif str(given).strip().lower() != role:
        raise AFDConfigError(
            f"afd.role={given!r} in --config, but this command runs the {role!r} role; expected {role!r} or no role",
            key="afd.role",
            value=given,
        )
    return parse_config(mapping)


@click.command("demo")
@click.option("--arch", default="Qwen3MoeForCausalLM", show_default=True, help="Architecture of the tiny model.")
@click.option("--connector", default="zmq", show_default=True, help="Connector name or alias.")
@click.option("--attention", "attention", type=click.IntRange(1, 16), default=1, show_default=True)
@click.option("--ffn", "ffn", type=click.IntRange(1, 16), default=1, show_default=True)
@click.option("--stages", type=click.IntRange(1, 8), default=1, show_default=True, help="Micro-batches per step.")
@click.option("--max-new-tokens", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--engine",
    type=click.Choice(["reference", "vllm"]),
    default="reference",
    show_default=True,
    help="Who runs the roles: afd-sdk's reference runtime on transformers, or vLLM's engine (needs vLLM installed).",
)
@click.option("--json", "as_json", is_flag=True)
def demo_cmd(
    arch: str,
    connector: str,
    attention: int,
    ffn: int,
    stages: int,
    max_new_tokens: int,
    seed: int,
    engine: str,
    as_json: bool,
) -> None:
    """Split a seeded tiny MoE model into real Attention and FFN processes and check it against native.

    With --engine vllm, each attention rank is a vLLM engine running the AFD alias, each FFN rank serves vLLM's
    own FFN modules, and native vLLM is the reference. Exit 1 when the split output differs from native.
    """
    _sigterm_as_interrupt()
    progress = None if as_json else _DemoProgress(max_new_tokens)
    event = progress.event if progress else None
    try:
        if engine == "vllm":
            if stages != 1:
                raise AFDConfigError(
                    f"--stages {stages} is not offered with --engine vllm (one forward per step); use 1",
                    key="stages",
                    value=stages,
                )
            from afd_sdk.integrations.vllm.demo import run_split_vllm

            summary = run_split_vllm(
                arch=arch,
                connector=connector,
                attention=attention,
                ffn=ffn,
                max_new_tokens=max_new_tokens,
                seed=seed,
                on_event=event,
            )
        else:
            from afd_sdk.runtime.demo import run_split

            summary = run_split(
                arch=arch,
                connector=connector,
                attention=attention,
                ffn=ffn,
                stages=stages,
                max_new_tokens=max_new_tokens,
                seed=seed,
                on_event=event,
            )
    finally:
        if progress is not None:
            progress.stop()
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    elif engine == "vllm":
        _print_vllm_demo(summary)
    else:
        _print_demo(summary)
    if not summary["match"]:
        raise click.exceptions.Exit(1)


def _sigterm_as_interrupt() -> None:
    """SIGTERM unwinds like Ctrl-C, so the worker processes are reaped either way."""
    import signal

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


class _DemoProgress:
    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            console=Console(stderr=True),
            transient=True,
        )
        self.task = self.progress.add_task("starting", total=total)
        self.progress.start()

    def event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "phase":
            self.progress.update(self.task, description=data["phase"])
        elif data.get("role") == "attention" and data.get("rank") == 0:
            ev = data.get("event")
            if ev == "step":
                self.progress.update(self.task, description="generating", completed=data["step"])
            elif ev == "ready":
                self.progress.update(self.task, description="handshake done; generating")
            elif ev == "reference":
                self.progress.update(self.task, description="running the native reference")

    def stop(self) -> None:
        self.progress.stop()


def _print_demo(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console.print(
        f"[bold]{s['architecture']}[/] split over [bold]{s['connector']}[/]: "
        f"{s['attention']} attention × {s['ffn']} FFN processes, {s['stages']} stage(s)"
    )
    for err in s["errors"]:
        console.print(f"[red]{err['role']}[{err['rank']}] failed ({err['error_type']}): {err['error']}[/]")
    for r in s["ranks"]:
        target = "every ffn rank (routed dispatch)" if r["ffn_rank"] is None else f"ffn rank {r['ffn_rank']}"
        expect = "bit-exact expected" if r["exact_expected"] else "batched MoE: within 1e-5"
        table = Table(title=f"attention rank {r['rank']} → {target} ({expect})")
        table.add_column("step", justify="right")
        table.add_column("max |logit diff|", justify="right")
        table.add_column("step time (ms)", justify="right")
        for i, d in enumerate(r["max_abs_diff_per_step"]):
            table.add_row(str(i), f"{d:.3g}", f"{r['step_ms'][i]:.1f}" if i < len(r["step_ms"]) else "-")
        console.print(table)
        console.print(f"  tokens equal to native: {r['tokens_equal']}   tokens: {r['tokens']}")
        if r["exchange_us_median"] is not None:
            console.print(f"  per-layer exchange latency (median): {r['exchange_us_median']:.0f} µs")
    verdict = "[green]MATCH[/]" if s["match"] else "[red]MISMATCH[/]"
    diff = "n/a" if s["max_abs_diff"] is None else f"{s['max_abs_diff']:.3g}"
    console.print(f"{verdict}: max |logit diff| {diff}, tokens equal: {s['tokens_equal']}, wall {s['wall_s']:.1f} s")


def _print_vllm_demo(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console.print(
        f"[bold]{s['architecture']}[/] in vLLM's engine, split over [bold]{s['connector']}[/]: "
        f"{s['attention']} attention engine(s) × {s['ffn']} FFN process(es) on vLLM's modules"
    )
    for err in s["errors"]:
        console.print(f"[red]{err['role']}[{err['rank']}] failed ({err['error_type']}): {err['error']}[/]")
    table = Table(title=f"against native vLLM (logprobs within {s['tolerance']:g})")
    for col in ("attention rank", "request", "tokens", "tokens equal", "max |logprob diff|"):
        table.add_column(col)
    for r in s["ranks"]:
        for i, toks in enumerate(r["tokens"] or []):
            same = r.get("native_tokens") is not None and toks == r["native_tokens"][i]
            table.add_row(
                str(r["rank"]),
                str(i),
                ",".join(map(str, toks)),
                str(same),
                "" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.3g}",
            )
    console.print(table)
    for i, st in enumerate(s["ffn_serve"]):
        steps = f"{st['steps']} engine steps, " if st["steps"] else ""  # routed dispatch serves work items
        console.print(f"  FFN rank {i} served {steps}{st['exchanges']} exchanges, {st['tokens']} tokens")
    verdict = "[green]MATCH[/]" if s["match"] else "[red]MISMATCH[/]"
    diff = "n/a" if s["max_abs_diff"] is None else f"{s['max_abs_diff']:.3g}"
    console.print(f"{verdict}: max |logprob diff| {diff}, tokens equal: {s['tokens_equal']}, wall {s['wall_s']:.1f} s")


@click.group("ffn")
def ffn_group() -> None:
    """FFN-role commands."""


@ffn_group.command("serve")
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--config", "config", required=True, help="AFD config: JSON string or path (role may be omitted).")
@click.option("--rank", type=click.IntRange(0), default=0, show_default=True, help="FFN role rank.")
@click.option(
    "--engine",
    type=click.Choice(["reference", "vllm"]),
    default="reference",
    show_default=True,
    help="reference: transformers modules; vllm: vLLM's own FFN modules, for attention ranks running in vLLM.",
)
@click.option("--dtype", default="float32", show_default=True, help="Model dtype (vLLM engine: must match attention).")
@click.option(
    "--world-port",
    "ports",
    type=click.IntRange(1, 65535),
    multiple=True,
    help="Serve one independent AFD world per port (replaces afd.port; repeat), e.g. one per `vllm serve` "
    "attention engine: each steps on its own, all share this process's weights.",
)
@click.option(
    "--replica",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Which of afd.ffn_replicas processes serving this FFN rank this one is: it serves the world(s) at "
    "port + REPLICA * afd.replica_port_stride (metrics on metrics_port + REPLICA), on afd.replica_hosts[REPLICA] "
    "where given; attention ranks fail over between replicas.",
)
@_METRICS_PORT
@click.option("--json", "as_json", is_flag=True)
def ffn_serve(
    model_dir: str,
    config: str,
    rank: int,
    engine: str,
    dtype: str,
    ports: tuple[int, ...],
    replica: int,
    metrics_port: int | None,
    as_json: bool,
) -> None:
    """Serve the FFN role of MODEL until every attention peer says goodbye.

    With --metrics-port, /metrics, /healthz and /readyz answer from start-up on (ready once every world's peers
    connected). Exit 0 when every world ended with its peers' goodbye; 3 when a peer was lost; 2 when the config
    is invalid.
    """
    from afd_sdk.connector import AFDConnector
    from afd_sdk.metrics import default_hub
    from afd_sdk.plugins import get_plugin_manager
    from afd_sdk.runtime.drain import Drain
    from afd_sdk.runtime.failover import replica_port, replica_world

    cfg = _role_config(config, "ffn", metrics_port)
    # the deployment's config, replica set included, before this replica's own world (which says ffn_replicas 1)
    connector_cls = get_plugin_manager().resolve_config(cfg).connector_cls
    if replica >= cfg.ffn_replicas:
        raise AFDConfigError(
            f"--replica {replica} needs afd.ffn_replicas > {replica}, but afd.ffn_replicas={cfg.ffn_replicas}; "
            f"expected a replica in [0, {cfg.ffn_replicas - 1}]",
            key="afd.ffn_replicas",
            value=cfg.ffn_replicas,
        )
    replicated = cfg.ffn_replicas > 1
    if replicated:
        stride = cfg.replica_port_stride
        ports = tuple(replica_port(p, replica, stride) for p in ports)
        if any(p > 65535 for p in ports):
            raise AFDConfigError(
                f"--world-port {' '.join(str(p - replica * stride) for p in ports)} with --replica {replica} gives "
                f"ports {list(ports)} (+ {replica} * afd.replica_port_stride={stride}); expected ports <= 65535",
                key="--world-port",
                value=list(ports),
            )
        # replicas of one rank on one host (no afd.replica_hosts) each serve their own world and metrics ports
        metrics = None if cfg.metrics_port is None else cfg.metrics_port + replica
        cfg = replica_world(cfg, replica, metrics_port=metrics)
    # routed dispatch has no step boundary on the FFN side to drain at; CAM drains with redundant experts only
    # (each world's connector says, when attached)
    drainable = issubclass(connector_cls, AFDConnector) or hasattr(connector_cls, "drain_refusal")
    drain = Drain(None if drainable else connector_cls.name)
    beacon: Any = None
    if replicated:
        from afd_sdk.runtime.replica_beacon import ReplicaBeacon, beacon_address

        # each world's beacon port, bound before the weights load (a port in use fails now), answering once they
        # are loaded: what the attention ranks' live-replica count reads
        at = {p: beacon_address(cfg.replace(port=p), rank) for p in ports or (cfg.port,)}
        beacon = ReplicaBeacon(at, resolve_wait_s=cfg.connect_timeout_s)
    try:
        # the endpoint answers /healthz while the weights load, which may take minutes
        ops = _start_ops(cfg, drain)
        try:
            hub = default_hub() if ops else None
            stats, worlds = _serve_ffn(model_dir, cfg, rank, engine, dtype, ports, hub, drain, beacon)
        finally:
            if ops is not None:
                ops.close()
    finally:
        if beacon is not None:
            beacon.close()
    _print_served(stats, worlds, as_json)


def _serve_ffn(
    model_dir: str,
    cfg: AFDConfig,
    rank: int,
    engine: str,
    dtype: str,
    ports: tuple[int, ...],
    hub: Any,
    drain: Any,
    beacon: Any = None,
) -> tuple[list[Any], list[int]]:
    """Load the FFN role and serve its worlds; an FFN replica's ``beacon`` answers the attention ranks' probes
    once the weights are loaded, for each world until that world ends (:mod:`afd_sdk.runtime.replica_beacon`)."""
    from afd_sdk.runtime.heap import freeze_startup_heap
    from afd_sdk.runtime.worlds import WorldOutcome, serve_worlds, served

    def ready(port: int) -> None:
        click.echo(f"ffn rank {rank}: attention peers of the world at port {port} connected", err=True)

    def done(out: WorldOutcome) -> None:
        if beacon is not None:
            beacon.retire(out.port)  # its attention ranks can no longer fail over to this world
        if out.error is None:
            steps = out.stats.steps if out.stats is not None else 0
            why = f"drained ({drain.op})" if drain.requested else "every attention peer said goodbye"
            click.echo(f"ffn rank {rank}: world at port {out.port} ended after {steps} steps: {why}", err=True)
        else:
            click.echo(
                f"ffn rank {rank}: world at port {out.port} failed ({type(out.error).__name__}): {out.error}", err=True
            )

    if engine == "vllm":
        from afd_sdk.integrations.vllm.ffn import open_ffn_role

        role = open_ffn_role(model_dir, cfg, rank=rank, dtype=dtype, ports=ports)
        connectors = role.connectors
        loaded = f"ffn rank {rank} (vLLM modules):"

        def serve() -> list[Any]:
            return served(role.serve(on_ready=ready, on_done=done, hub=hub, drain=drain))
    else:
        from afd_sdk.runtime.session import open_role

        session = open_role(cfg, model_dir, role_rank=rank, ports=ports)
        connectors = session.connectors
        loaded = f"ffn rank {rank}: {session.fingerprint.architecture},"

        def serve() -> list[Any]:
            return served(
                serve_worlds(session.connectors, session.model, on_ready=ready, on_done=done, hub=hub, drain=drain)
            )

    worlds = [c.config.port for c in connectors]
    if beacon is not None:
        beacon.start()  # the weights are loaded: this replica can take a failover from here on
    click.echo(f"{loaded} waiting for attention peers at port(s) {worlds}", err=True)
    freeze_startup_heap()
    return serve(), worlds


def _start_ops(cfg: AFDConfig, drain: Any = None) -> Any:
    """The role's ``/metrics`` + health endpoint when the config asks for one (else ``None``), announced on stderr."""
    from afd_sdk.metrics import default_hub
    from afd_sdk.runtime.ops_server import start_ops_server

    ops = start_ops_server(cfg, default_hub(), drain)
    if ops is not None:
        host, port = ops.address
        click.echo(f"metrics and health: http://{host}:{port}/metrics, /healthz, /readyz", err=True)
    return ops


def _print_served(stats: list[Any], ports: list[int], as_json: bool) -> None:
    if as_json:
        rows = [s.as_dict() for s in stats]
        click.echo(
            json.dumps(
                rows[0] if len(rows) == 1 else {"worlds": [{"port": p, **r} for p, r in zip(ports, rows, strict=True)]}
            )
        )
        return
    for port, s in zip(ports, stats, strict=True):
        click.echo(
            f"world at port {port}: served {s.steps} steps, {s.exchanges} exchanges, {s.tokens} tokens", err=True
        )


@click.group("attention")
def attention_group() -> None:
    """Attention-role commands."""


@attention_group.command("generate")
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--config", "config", required=True, help="AFD config: JSON string or path (role may be omitted).")
@click.option(
    "--prompt-ids", "prompt_ids", multiple=True, required=True, help="Comma-separated token ids; repeat per request."
)
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=16, show_default=True)
@click.option("--rank", type=click.IntRange(0), default=0, show_default=True, help="Attention role rank.")
@click.option("--reference", is_flag=True, help="Also run the native model and compare.")
@_METRICS_PORT
@click.option("--json", "as_json", is_flag=True)
def attention_generate(
    model_dir: str,
    config: str,
    prompt_ids: tuple[str, ...],
    max_new_tokens: int,
    rank: int,
    reference: bool,
    metrics_port: int | None,
    as_json: bool,
) -> None:
    """Greedy generation on the Attention role of MODEL against running FFN server(s).

    With --metrics-port, /metrics, /healthz and /readyz answer while it runs. Exit 3 when an FFN peer was lost.
    """
    from afd_sdk.metrics import default_hub, tracking
    from afd_sdk.runtime.attention_runner import AttentionRunner
    from afd_sdk.runtime.heap import freeze_startup_heap
    from afd_sdk.runtime.reference import compare, reference_generate
    from afd_sdk.runtime.session import open_role

    prompts = [_parse_ids(p) for p in prompt_ids]
    cfg = _role_config(config, "attention", metrics_port)
    ops = _start_ops(cfg)
    try:
        session = open_role(cfg, model_dir, role_rank=rank)
        rec = default_hub().for_connector(session.connector) if ops is not None else None
        try:
            with tracking(rec) as connected:
                session.connector.init()
                connected()
                freeze_startup_heap()
                runner = AttentionRunner.for_session(session, metrics=rec)
                result = runner.generate(prompts, max_new_tokens)
        finally:
            session.connector.close()
    finally:
        if ops is not None:
            ops.close()
    out: dict[str, Any] = {"tokens": result.tokens, "step_ms": [s * 1000 for s in result.step_s]}
    if reference:
        native = session.binding.load_native(model_dir)
        out.update(compare(result, reference_generate(native, prompts, max_new_tokens, session.config.num_stages)))
    if as_json:
        click.echo(json.dumps(out))
    else:
        for i, toks in enumerate(result.tokens):
            click.echo(f"request {i}: {','.join(map(str, toks))}")
        if reference:
            click.echo(f"native match: tokens_equal={out['tokens_equal']} max_abs_diff={out['max_abs_diff']:.3g}")


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise AFDConfigError(
            f"--prompt-ids {text!r} is invalid; expected comma-separated integers", key="prompt-ids", value=text
        ) from None
    if not ids or min(ids) < 0:
        raise AFDConfigError(f"--prompt-ids {text!r} is invalid; expected non-negative token ids", key="prompt-ids")
    return ids


def attach(cli: click.Group) -> None:
    cli.add_command(demo_cmd)
    cli.add_command(ffn_group)
    cli.add_command(attention_group)
