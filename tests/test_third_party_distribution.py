"""A throwaway third-party distribution is discovered through the ``afd_sdk`` entry point.

It is built and installed for real (``pip install --target``), so
importlib.metadata sees its dist-info exactly as for any installed package;
the target directory goes on PYTHONPATH of the subprocesses only, leaving the
test environment untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "afd-thirdparty-demo"
version = "0.3.1"
dependencies = ["afd-sdk"]

[project.entry-points.afd_sdk]
demo = "afd_thirdparty_demo.plugin"
broken = "afd_thirdparty_broken"

[tool.setuptools]
packages = ["afd_thirdparty_demo", "afd_thirdparty_broken"]
"""

PLUGIN = """
from afd_sdk import hookimpl


@hookimpl
def afd_register_connectors(register):
    register("DemoLoopbackAFDConnector", "afd_thirdparty_demo.connector:DemoLoopbackAFDConnector", aliases=("demo",))


@hookimpl
def afd_register_model_adapters(register):
    register("DemoMoeForCausalLM", "afd_thirdparty_demo.adapter:DemoAdapter")
"""

CONNECTOR = '''
"""A minimal third-party connector: the public ZMQ building blocks under its own name."""
from afd_connectors.zmq.connector import ZmqAFDConnector


class DemoLoopbackAFDConnector(ZmqAFDConnector):
    name = "DemoLoopbackAFDConnector"
'''

ADAPTER = """
from afd_sdk import ModelAdapter, WeightRole


class DemoAdapter(ModelAdapter):
    name = "demo"
    version = "0.3.1"
    architectures = ("DemoMoeForCausalLM",)

    def weight_role(self, name, *, compute_gate_on_attention=False):
        return WeightRole.FFN if ".mlp." in name else WeightRole.ATTENTION
"""

CONFORMANCE = """
from afd_sdk.testing import ConnectorConformance


class TestDemoConnector(ConnectorConformance):
    connector = "demo"
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    (src / "pyproject.toml").write_text(PYPROJECT)
    pkg = src / "afd_thirdparty_demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "plugin.py").write_text(PLUGIN)
    (pkg / "connector.py").write_text(CONNECTOR)
    (pkg / "adapter.py").write_text(ADAPTER)
    broken = src / "afd_thirdparty_broken"
    broken.mkdir()
    (broken / "__init__.py").write_text('raise ImportError("simulated: libfabric.so.1 not found")\n')
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
        timeout=300,
    )
    assert list(target.glob("afd_thirdparty_demo-0.3.1.dist-info"))
    return target


def afd(target: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in ("AFD_PLUGINS", "AFD_DISABLE_PLUGINS")}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join([str(target), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-m", "afd_sdk.cli", *args], capture_output=True, text=True, env=full_env, timeout=120
    )


def test_listed_with_distribution_and_broken_one_reported(installed):
    res = afd(installed, "plugins", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    plugins = {p["name"]: p for p in data["plugins"]}
    assert plugins["demo"]["distribution"] == "afd-thirdparty-demo" and plugins["demo"]["version"] == "0.3.1"
    assert plugins["demo"]["registered"]["connectors"] == ["DemoLoopbackAFDConnector"]
    assert plugins["demo"]["registered"]["model_adapters"] == ["DemoMoeForCausalLM"]
    assert plugins["broken"]["status"] == "failed" and "libfabric.so.1" in plugins["broken"]["error"]
    # the others keep working, built-ins included
    assert {"ZmqAFDConnector", "DemoLoopbackAFDConnector"} <= {c["name"] for c in data["connectors"]}
    check = afd(installed, "config", "check", '{"afd": {"role": "ffn", "connector": "demo"}}', "--json")
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["connector_class"] == "afd_thirdparty_demo.connector:DemoLoopbackAFDConnector"


def test_allow_and_block_lists(installed):
    only_broken = json.loads(afd(installed, "plugins", "--json", AFD_PLUGINS="broken").stdout)
    status = {p["name"]: (p["status"], p["reason"]) for p in only_broken["plugins"]}
    assert status["demo"] == ("skipped", "not in AFD_PLUGINS") and status["broken"][0] == "failed"
    none = json.loads(afd(installed, "plugins", "--json", AFD_PLUGINS="").stdout)
    assert "DemoLoopbackAFDConnector" not in {c["name"] for c in none["connectors"]}
    blocked = afd(installed, "config", "check", '{"role": "ffn", "connector": "demo"}', AFD_DISABLE_PLUGINS="demo")
    assert blocked.returncode == 2 and "connector 'demo' is not registered" in blocked.stderr


def test_conformance_suite_runs_from_outside(installed, tmp_path):
    (tmp_path / "test_demo_conformance.py").write_text(textwrap.dedent(CONFORMANCE))
    env = {**os.environ, "PYTHONPATH": str(installed)}
    env.pop("AFD_PLUGINS", None)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_demo_conformance.py"),
            "-k",
            "multi_stage or handshake or killed",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "4 passed" in res.stdout, res.stdout[-2000:]
