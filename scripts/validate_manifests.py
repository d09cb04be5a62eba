#!/usr/bin/env python3
"""Validate the Kubernetes manifests of deploy/k8s: schemas, then what AFD needs of them.

Usage: ``python scripts/validate_manifests.py [DIR] [--kubernetes-version 1.33] [--json]``; exit 0 when every
object is valid, 1 with one line per problem otherwise.

* Built-in kinds (ConfigMap, Service, StatefulSet, ...) against the Kubernetes OpenAPI schemas that
  ``kubernetes-validate`` bundles, strict (an unknown field is an error, as ``kubectl --validate=strict``).
* ``LeaderWorkerSet`` against the CRD's own ``openAPIV3Schema`` (vendored in ``deploy/k8s/schemas``, see
  its SOURCE.md), closed the same way: ``kubernetes-validate`` has no CRD schemas and only warns on them.
* The AFD rules: the ConfigMap's ``attention.json`` and ``ffn.json`` parse as AFD configs of their roles and
  agree on every key but ``role``; ``num_attention_ranks`` is the LeaderWorkerSet's size and
  ``num_ffn_ranks`` the FFN StatefulSet's replicas, and with more than one FFN rank ``ffn_hosts`` lists the
  pods' stable names (``afd-ffn-r.afd-ffn``: FFN rank r binds the address of its own pod);
  ``ARCHITECTURE`` is an AFD alias of an installed adapter and every ``vllm serve`` selects it and AFD's
  worker extension, one DP rank per pod; every probe and ``prometheus.io/port`` names a port the
  container declares; no probe or scrape targets vLLM's data-parallel RPC port.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33"
LWS_API = "leaderworkerset.x-k8s.io/v1"
#: vLLM's --data-parallel-rpc-port in the manifests: its ZMQ handshake breaks on an HTTP probe or scrape
DP_RPC_PORT_NAME = "dp-rpc"
#: what every `vllm serve` of the attention group needs beyond --additional-config (docs/vllm.md)
VLLM_SERVE_FLAGS = (
    "--hf-overrides",
    "--worker-extension-cls afd_sdk.integrations.vllm.extension.AFDWorkerExtension",
    "--additional-config",
    "--data-parallel-size-local 1",
)


def load_objects(directory: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(file name, object)`` for every YAML document of ``directory/*.yaml``, in file order."""
    import yaml

    out = []
    for path in sorted(directory.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its properties.

    The API server prunes unknown fields of a structural CRD silently; a manifest with a typo (``sise: 2``)
    would apply and do nothing. Closing the schema turns the typo into an error here.
    """
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_validator(schema_path: Path) -> Any:
    import jsonschema

    doc = json.loads(schema_path.read_text())
    return jsonschema.Draft4Validator(closed(doc["openAPIV3Schema"]))


def _where(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind', '?')}/{obj.get('metadata', {}).get('name', '?')}"


def schema_problems(objects: list[tuple[str, dict[str, Any]]], kubernetes_version: str, schemas: Path) -> list[str]:
    import kubernetes_validate

    lws = crd_validator(schemas / "leaderworkerset.x-k8s.io_v1.json")
    problems = []
    for name, obj in objects:
        if obj.get("apiVersion") == LWS_API and obj.get("kind") == "LeaderWorkerSet":
            for err in sorted(lws.iter_errors(obj), key=lambda e: list(e.absolute_path)):
                path = ".".join(str(p) for p in err.absolute_path) or "<root>"
                problems.append(f"{name}: {_where(obj)}: {path}: {err.message}")
            continue
        try:
            kubernetes_validate.validate(obj, kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = ".".join(str(p) for p in err.path) or "<root>"
            problems.append(f"{name}: {_where(obj)}: {path}: {err.message}")
        except kubernetes_validate.SchemaNotFoundError as err:  # str() of it is empty; .message says it
            problems.append(f"{name}: {_where(obj)}: no schema: {err.message}")
    return problems


def _containers(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """``(template name, pod template, container)`` of a workload."""
    spec = obj.get("spec", {})
    templates = []
    if obj.get("kind") == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate", {})
        templates = [(k, lwt[k]) for k in ("leaderTemplate", "workerTemplate") if k in lwt]
    elif "template" in spec:
        templates = [("template", spec["template"])]
    for tname, template in templates:
        for c in template.get("spec", {}).get("containers", []):
            yield tname, template, c


def afd_problems(objects: list[tuple[str, dict[str, Any]]]) -> list[str]:
    from afd_sdk.config import parse_config
    from afd_sdk.errors import AFDConfigError, AFDError

    problems: list[str] = []
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for _, obj in objects:
        by_kind.setdefault(obj.get("kind", ""), []).append(obj)
    maps = [m for m in by_kind.get("ConfigMap", []) if m.get("metadata", {}).get("name") == "afd-config"]
    if len(maps) != 1:
        return [f"expected one ConfigMap named afd-config; found {len(maps)}"]
    data = maps[0].get("data", {})
    configs = {}
    for role, key in (("attention", "attention.json"), ("ffn", "ffn.json")):
        try:
            raw = json.loads(data[key])
            raw = raw["afd"] if role == "attention" else raw  # vLLM's --additional-config wraps it
            configs[role] = parse_config(raw)
        except (KeyError, ValueError, AFDConfigError) as exc:
            problems.append(f"ConfigMap/afd-config: {key}: {exc}")
    if len(configs) == 2:
        attn, ffn = (configs[r].to_dict() for r in ("attention", "ffn"))
        if attn["role"] != "attention" or ffn["role"] != "ffn":
            problems.append(f"ConfigMap/afd-config: roles are {attn['role']!r} and {ffn['role']!r}")
        differ = sorted(k for k in attn if k != "role" and attn[k] != ffn.get(k))
        if differ:
            problems.append(f"ConfigMap/afd-config: attention.json and ffn.json differ in {differ}")
        for lws in by_kind.get("LeaderWorkerSet", []):
            size = lws["spec"]["leaderWorkerTemplate"].get("size", 1)
            if size != attn["num_attention_ranks"]:
                problems.append(
                    f"{_where(lws)}: leaderWorkerTemplate.size={size}; expected num_attention_ranks="
                    f"{attn['num_attention_ranks']} (one DP rank per pod)"
                )
        for sts in by_kind.get("StatefulSet", []):
            replicas = sts["spec"].get("replicas", 1)
            if replicas != ffn["num_ffn_ranks"]:
                problems.append(f"{_where(sts)}: replicas={replicas}; expected num_ffn_ranks={ffn['num_ffn_ranks']}")
            ranks = ffn["num_ffn_ranks"]
            names = [f"{sts['metadata']['name']}-{r}.{sts['spec'].get('serviceName', '')}" for r in range(ranks)]
            if ranks > 1 and list(ffn.get("ffn_hosts") or ()) != names:
                problems.append(
                    f"ConfigMap/afd-config: ffn_hosts={ffn.get('ffn_hosts')!r} with num_ffn_ranks={ranks}; expected "
                    f"{names} (FFN rank r binds afd.ffn_hosts[r]: pod r's stable name; docs/deploy.md)"
                )
    arch = str(data.get("ARCHITECTURE", ""))
    try:
        from afd_sdk.plugins import get_plugin_manager

        if not arch.startswith("AFD"):
            raise ValueError("not an AFD alias")
        get_plugin_manager().adapter_class(arch.removeprefix("AFD"))
    except (ValueError, AFDError) as exc:  # an unknown architecture: the message names it
        problems.append(
            f"ConfigMap/afd-config: ARCHITECTURE={arch!r} is not an AFD alias of an installed adapter ({exc})"
        )
    for _, obj in objects:
        for tname, template, c in _containers(obj):
            where = f"{_where(obj)}: {tname}: container {c.get('name')}"
            ports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
            command = " ".join(" ".join(c.get(k, [])) for k in ("command", "args"))
            if "vllm serve" in command:
                missing = [f for f in VLLM_SERVE_FLAGS if f not in command]
                if missing:
                    problems.append(f"{where}: `vllm serve` lacks {missing} (the AFD attention role needs them)")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                target = c.get(probe, {}).get("httpGet", {}).get("port")
                if target is None:
                    continue
                if isinstance(target, str) and target not in ports:
                    problems.append(f"{where}: {probe} port {target!r} is not a declared port {sorted(ports)}")
                if target in (DP_RPC_PORT_NAME, ports.get(DP_RPC_PORT_NAME)):
                    problems.append(f"{where}: {probe} targets vLLM's data-parallel RPC port")
            scrape = template.get("metadata", {}).get("annotations", {}).get("prometheus.io/port")
            if scrape is not None:
                if not str(scrape).isdigit():
                    problems.append(f"{where}: prometheus.io/port={scrape!r} is not a port number")
                elif int(scrape) == ports.get(DP_RPC_PORT_NAME):
                    problems.append(f"{where}: prometheus.io/port scrapes vLLM's data-parallel RPC port")
                elif int(scrape) not in ports.values():
                    problems.append(f"{where}: prometheus.io/port={scrape} is not a declared port")
    return problems


def validate(directory: Path = DEFAULT_DIR, kubernetes_version: str = KUBERNETES_VERSION) -> dict[str, Any]:
    objects = load_objects(directory)
    problems = schema_problems(objects, kubernetes_version, directory / "schemas")
    if not problems:  # the AFD rules read fields the schemas vouch for
        problems = afd_problems(objects)
    return {
        "directory": str(directory),
        "kubernetes_version": kubernetes_version,
        "objects": [f"{name}: {_where(obj)}" for name, obj in objects],
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--kubernetes-version", default=KUBERNETES_VERSION)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = validate(args.directory, args.kubernetes_version)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for line in report["objects"]:
            print(f"checked {line}")
        for line in report["problems"]:
            print(f"error: {line}", file=sys.stderr)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
