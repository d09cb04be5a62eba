"""deploy/k8s validates: Kubernetes schemas, the LeaderWorkerSet CRD schema, and AFD's own rules; and the
validator fails on what it must catch (a kit that passes a broken manifest is a bug)."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kubernetes_validate", reason="the [dev] extra installs kubernetes-validate (scripts/bootstrap.sh)")

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("validate_manifests", ROOT / "scripts" / "validate_manifests.py")
vm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vm)

DIR = ROOT / "deploy" / "k8s"


@pytest.fixture(scope="module")
def objects():
    return vm.load_objects(DIR)


def _problems(objects) -> list[str]:
    return vm.schema_problems(objects, vm.KUBERNETES_VERSION, DIR / "schemas")


def _find(objects, kind: str) -> dict:
    (obj,) = [o for _, o in objects if o["kind"] == kind]
    return obj


def test_the_shipped_manifests_are_valid_from_the_command_line():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "validate_manifests.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["problems"] == [], report["problems"]
    kinds = sorted(o.split(": ")[1].split("/")[0] for o in report["objects"])
    assert kinds == ["ConfigMap", "LeaderWorkerSet", "PersistentVolumeClaim", "Service", "Service", "StatefulSet"]


@pytest.mark.parametrize(
    ("break_it", "expected"),
    [
        # the CRD schema: a wrong type, an unknown field (closed schema), a wrong enum
        (lambda o: _find(o, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"].update(size="two"), "is not of type"),
        (lambda o: _find(o, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"].update(sise=2), "'sise' was unexpected"),
        (lambda o: _find(o, "LeaderWorkerSet")["spec"].update(startupPolicy="Eventually"), "is not one of"),
        # a built-in kind, strict: an unknown field and a wrong type
        (lambda o: _find(o, "StatefulSet")["spec"].update(replica=1), "unexpected"),
        (
            lambda o: _find(o, "StatefulSet")["spec"]["template"]["spec"]["containers"][0].update(ports="9400"),
            "is not of type",
        ),
    ],
    ids=["lws-type", "lws-unknown-field", "lws-enum", "sts-unknown-field", "sts-type"],
)
def test_a_schema_error_is_reported_with_its_path(objects, break_it, expected):
    broken = copy.deepcopy(objects)
    break_it(broken)
    problems = _problems(broken)
    assert len(problems) >= 1 and any(expected in p for p in problems), problems


def _worker(objects) -> dict:
    return _find(objects, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]


def _set_config(objects, key: str, **changes) -> None:
    data = _find(objects, "ConfigMap")["data"]
    raw = json.loads(data[key])
    (raw["afd"] if "afd" in raw else raw).update(changes)
    data[key] = json.dumps(raw)


def _ffn_pool(objects, hosts: list[str] | None) -> None:
    """Two FFN ranks: two StatefulSet pods, ``num_ffn_ranks`` 2 and ``ffn_hosts`` ``hosts`` in both configs."""
    _find(objects, "StatefulSet")["spec"].update(replicas=2)
    for key in ("attention.json", "ffn.json"):
        _set_config(objects, key, num_ffn_ranks=2, ffn_hosts=hosts)


def test_an_ffn_pool_of_two_pods_with_their_stable_names_is_valid(objects):
    pool = copy.deepcopy(objects)
    _ffn_pool(pool, hosts=["afd-ffn-0.afd-ffn", "afd-ffn-1.afd-ffn"])
    assert _problems(pool) == [] and vm.afd_problems(pool) == []


@pytest.mark.parametrize(
    ("break_it", "expected"),
    [
        (lambda o: _set_config(o, "ffn.json", port=29700), "differ in ['port']"),
        (lambda o: _set_config(o, "attention.json", conector="zmq"), "afd.conector is not a known key"),
        (lambda o: _set_config(o, "attention.json", num_attention_ranks=3, metrics_port=9400), "num_attention_ranks=3"),
        (lambda o: _find(o, "StatefulSet")["spec"].update(replicas=2), "expected num_ffn_ranks=1"),
        (lambda o: _ffn_pool(o, hosts=None), "ffn_hosts=None with num_ffn_ranks=2"),
        (lambda o: _ffn_pool(o, hosts=["afd-ffn-0.afd-ffn", "afd-ffn-2.afd-ffn"]), "'afd-ffn-1.afd-ffn'"),
        (lambda o: _find(o, "ConfigMap")["data"].update(ARCHITECTURE="Qwen3MoeForCausalLM"), "not an AFD alias"),
        (lambda o: _find(o, "ConfigMap")["data"].update(ARCHITECTURE="AFDNoSuchModel"), "'AFDNoSuchModel' is not"),
        (lambda o: _worker(o)["args"].__setitem__(0, _worker(o)["args"][0].replace("--hf-overrides", "")), "lacks"),
        (
            lambda o: _worker(o)["args"].__setitem__(0, _worker(o)["args"][0].replace("-local 1", "-local 2")),
            "--data-parallel-size-local 1",
        ),
        (
            lambda o: _find(o, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"][
                "containers"
            ][0]["readinessProbe"]["httpGet"].update(port="http"),
            "is not a declared port",
        ),
        (
            lambda o: _find(o, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"][
                "containers"
            ][0]["livenessProbe"]["httpGet"].update(port="dp-rpc"),
            "data-parallel RPC port",
        ),
    ],
    ids=[
        "configs-disagree",
        "unknown-afd-key",
        "ranks-vs-size",
        "ffn-replicas",
        "ffn-pool-without-hosts",
        "ffn-pool-wrong-host",
        "not-an-alias",
        "unknown-alias",
        "no-alias-flag",
        "two-ranks-a-pod",
        "undeclared-probe-port",
        "dp-rpc-probe",
    ],
)
def test_an_afd_rule_broken_is_reported(objects, break_it, expected):
    broken = copy.deepcopy(objects)
    break_it(broken)
    assert _problems(broken) == []  # schema-valid: only the AFD rules can catch it
    problems = vm.afd_problems(broken)
    assert any(expected in p for p in problems), problems
