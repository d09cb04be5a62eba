"""afd-sdk's public API as data, and the CI check that it only changes on purpose.

The public API is what ``docs/api.md`` lists: the modules in :data:`PUBLIC_MODULES` (each name in its
``__all__``, with signatures and public class members), the ``afd`` CLI (commands and options), the config keys
of ``additional_config["afd"]``, the Prometheus metric names and the entry-point groups. The snapshot is
``api/public-api.json``, committed.

    python scripts/api_snapshot.py            # check: exit 1 on any difference, naming each
    python scripts/api_snapshot.py --update   # rewrite the snapshot (then add a CHANGELOG.md line)

The check also fails when the commit that last changed the snapshot did not change ``CHANGELOG.md`` too: a
public name is removed or changed only with a line that tells its users (and a deprecated alias, see
``afd_sdk._compat``).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "api" / "public-api.json"

#: the modules whose ``__all__`` is public (docs/api.md has one section per audience)
PUBLIC_MODULES = (
    "afd_sdk",
    "afd_sdk.adapter",
    "afd_sdk.capabilities",
    "afd_sdk.checkpoints",
    "afd_sdk.config",
    "afd_sdk.connector",
    "afd_sdk.control",
    "afd_sdk.dispatch",
    "afd_sdk.errors",
    "afd_sdk.ffn_output",
    "afd_sdk.hookspecs",
    "afd_sdk.integrations.transformers",
    "afd_sdk.integrations.vllm",
    "afd_sdk.metadata",
    "afd_sdk.metrics",
    "afd_sdk.plugins",
    "afd_sdk.proxy",
    "afd_sdk.registry",
    "afd_sdk.testing",
    "afd_sdk.topology",
    "afd_sdk.weight_rules",
    "afd_sdk.weights",
    "afd_sdk.wire",
    "afd_connectors.zmq.connector",
    "afd_connectors.p2p.connector",
    "afd_connectors.shm.connector",
    "afd_connectors.cam.connector",
)

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
_STR_SET = re.compile(r"\{('[^'{}]*'(?:, '[^'{}]*')*)\}")  # a set of strings: its repr's order is the hash's


def _stable(text: str) -> str:
    text = _ADDRESS.sub("", text)
    return _STR_SET.sub(lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", text)


def _signature(obj: Any) -> str:
    try:
        return _stable(str(inspect.signature(obj)))
    except (TypeError, ValueError):  # builtins without a signature
        return "(...)"


def _describe(obj: Any) -> dict[str, Any]:
    if inspect.isclass(obj):
        members: dict[str, str] = {}
        for name, value in sorted(vars(obj).items()):
            if name.startswith("_") and name != "__init__":
                continue
            if isinstance(value, (classmethod, staticmethod)):
                members[name] = f"{type(value).__name__} {_signature(value.__func__)}"
            elif isinstance(value, property):
                members[name] = "property"
            elif inspect.isfunction(value):
                members[name] = _signature(value)
            else:
                members[name] = "attribute"
        bases = [f"{b.__module__}.{b.__qualname__}" for b in obj.__bases__]
        return {"kind": "class", "bases": bases, "members": members}
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return {"kind": "function", "signature": _signature(obj)}
    if inspect.ismodule(obj):
        return {"kind": "module", "name": obj.__name__}
    return {"kind": "value", "type": type(obj).__name__}


def _cli() -> dict[str, list[str]]:
    import click

    from afd_sdk.cli import cli

    out: dict[str, list[str]] = {}

    def walk(cmd: click.Command, path: str) -> None:
        out[path] = sorted(
            opt
            for p in cmd.params
            for opt in ([*p.opts, *p.secondary_opts] if isinstance(p, click.Option) else [p.name])
        )
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            walk(sub, f"{path} {name}")

    walk(cli, "afd")
    return out


def _metric_names() -> list[str]:
    from afd_sdk.metrics import MetricsHub, collector

    return sorted(family.name for family in collector(MetricsHub()).collect())


def snapshot() -> dict[str, Any]:
    """The public API of the code importable here."""
    warnings.simplefilter("ignore", DeprecationWarning)
    python: dict[str, dict[str, Any]] = {}
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        python[name] = {attr: _describe(getattr(module, attr)) for attr in sorted(module.__all__)}
    import msgspec

    from afd_sdk.config import AFDConfig
    from afd_sdk.plugins import ENTRY_POINT_GROUP

    return {
        "python": python,
        "cli": _cli(),
        "config_keys": sorted(f.name for f in msgspec.structs.fields(AFDConfig)),
        "metrics": _metric_names(),
        "entry_point_groups": [ENTRY_POINT_GROUP, "vllm.general_plugins"],
    }


def _flatten(data: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(data, dict):
        out: dict[str, str] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}/{key}" if prefix else key))
        return out
    return {prefix: json.dumps(data)}


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per removed, changed or added entry (``removed`` and ``changed`` break users)."""
    before, after = _flatten(old), _flatten(new)
    lines = [f"removed: {k} = {before[k]}" for k in sorted(before.keys() - after.keys())]
    lines += [
        f"changed: {k}: {before[k]} -> {after[k]}"
        for k in sorted(before.keys() & after.keys())
        if before[k] != after[k]
    ]
    lines += [f"added:   {k} = {after[k]}" for k in sorted(after.keys() - before.keys())]
    return lines


def changelog_rule() -> str | None:
    """Why a commit that changed the snapshot breaks the CHANGELOG rule (it must change CHANGELOG.md too), or
    ``None``. Every commit in the history that touched the snapshot is checked."""
    git = ["git", "-C", str(ROOT)]
    try:
        commits = subprocess.run(
            [*git, "log", "--format=%H", "--", str(SNAPSHOT)], capture_output=True, text=True, check=True
        ).stdout.split()
        for commit in commits:
            files = subprocess.run(
                [*git, "show", "--name-only", "--format=", commit], capture_output=True, text=True, check=True
            ).stdout.split()
            if "CHANGELOG.md" not in files:
                return f"commit {commit[:10]} changed {SNAPSHOT.relative_to(ROOT)} without a CHANGELOG.md line"
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"cannot read git history to check CHANGELOG.md ({exc}); run the check in a git clone"
    return None  # an uncommitted snapshot change is judged when it is committed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="rewrite the snapshot from the code")
    parser.add_argument("--snapshot", type=Path, default=SNAPSHOT, help="the snapshot file to check against")
    args = parser.parse_args(argv)
    live = snapshot()
    if args.update:
        args.snapshot.parent.mkdir(parents=True, exist_ok=True)
        args.snapshot.write_text(json.dumps(live, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.snapshot}; add a CHANGELOG.md line for every removed or changed entry")
        return 0
    committed = json.loads(args.snapshot.read_text())
    diff = differences(committed, live)
    if diff:
        print(f"error: the public API differs from {args.snapshot} ({len(diff)} entries):", file=sys.stderr)
        for line in diff:
            print(f"  {line}", file=sys.stderr)
        print(
            "a removal or change needs a deprecated alias (afd_sdk._compat) and a CHANGELOG.md line; then "
            "`python scripts/api_snapshot.py --update` and commit both",
            file=sys.stderr,
        )
        return 1
    problem = changelog_rule() if args.snapshot == SNAPSHOT else None
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    names = sum(len(v) for v in live["python"].values())
    print(
        f"public API unchanged: {names} names in {len(live['python'])} modules, {len(live['cli'])} CLI commands, "
        f"{len(live['config_keys'])} config keys, {len(live['metrics'])} metrics"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
