"""The wheel tier: afd-sdk as users install it.

``scripts/bootstrap-wheels.sh`` builds every distribution (an sdist, then a wheel from that sdist in an isolated
build, as ``pip install afd-sdk`` does) into ``dist/`` and installs only those wheels, non-editable, into a new
``.venv-wheels``. These tests read the artefacts and run ``afd`` from that environment, never from this tree.
Without the environment they skip locally (saying how to make it) and fail under CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "dist"
VENV = ROOT / ".venv-wheels"
PY = VENV / "bin" / "python"

#: distribution -> (wheel name prefix, the source roots of its packages)
DISTRIBUTIONS = {
    "afd-sdk": ("afd_sdk-", [ROOT / "afd_sdk", ROOT / "connectors" / "afd_connectors"]),
    "afd-models-qwen": ("afd_models_qwen-", [ROOT / "models" / "qwen" / "afd_models_qwen"]),
    "afd-models-deepseek": ("afd_models_deepseek-", [ROOT / "models" / "deepseek" / "afd_models_deepseek"]),
    "afd-connector-nixl": ("afd_connector_nixl-", [ROOT / "connectors" / "nixl" / "afd_connector_nixl"]),
}
BUNDLED_PLUGINS = {"afd_sdk.default_plugin", "afd_connectors.plugin", "qwen", "deepseek", "nixl"}
CONNECTORS = {"ZmqAFDConnector", "P2pNcclAFDConnector", "ShmAFDConnector", "CAMAsyncAFDConnector", "NixlAFDConnector"}


@pytest.fixture(scope="module", autouse=True)
def wheel_env():
    if PY.exists() and DIST.is_dir():
        return
    why = f"{VENV.name} or dist/ is missing: ./scripts/bootstrap-wheels.sh makes them"
    if os.environ.get("CI") == "true":
        pytest.fail(f"the wheel tier must run in CI: {why}")
    pytest.skip(why)


def _wheel(prefix: str) -> Path:
    (path,) = DIST.glob(f"{prefix}*.whl")
    return path


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd="/", env=env)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
def test_every_package_directory_ships_in_the_wheel(dist):
    prefix, roots = DISTRIBUTIONS[dist]
    names = zipfile.ZipFile(_wheel(prefix)).namelist()
    for root in roots:
        for init in root.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.relative_to(root.parent).as_posix()
            assert rel in names, f"{dist}'s wheel lacks package {init.parent.relative_to(root.parent)}"
            for module in init.parent.glob("*.py"):
                assert module.relative_to(root.parent).as_posix() in names, f"{dist}'s wheel lacks {module.name}"


def test_sdist_carries_every_native_source():
    (sdist,) = DIST.glob("afd_sdk-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    native = [p for ext in ("*.c", "*.cpp", "*.h") for p in (ROOT / "connectors" / "afd_connectors").rglob(ext)]
    assert len(native) >= 8
    for path in native:
        assert path.relative_to(ROOT).as_posix() in names, f"the sdist lacks {path.relative_to(ROOT)}"
    assert "setup.py" in names and "CHANGELOG.md" in names
    assert not any(n.endswith((".so", "_torch_build.json")) for n in names), "a local build output shipped"


def test_the_environment_runs_the_installed_wheels_not_this_tree():
    code = (
        "import json, afd_sdk, afd_connectors, afd_models_qwen; from importlib.metadata import distribution as d; "
        "print(json.dumps({'files': [afd_sdk.__file__, afd_connectors.__file__, afd_models_qwen.__file__], "
        "'direct_url': [d(n).read_text('direct_url.json') for n in ('afd-sdk', 'afd-models-qwen')]}))"
    )
    out = json.loads(_run(str(PY), "-c", code).stdout)
    site = str(VENV / "lib")
    assert all(f.startswith(site) for f in out["files"]), out["files"]
    for direct in out["direct_url"]:  # pip records a local wheel install; an editable one says "editable"
        assert direct is None or '"editable": true' not in direct, direct


def test_afd_plugins_lists_every_bundled_plugin_without_a_load_error():
    data = json.loads(_run(str(VENV / "bin" / "afd"), "plugins", "--json").stdout)
    status = {p["name"]: (p["status"], p["error"]) for p in data["plugins"]}
    assert BUNDLED_PLUGINS <= set(status), status
    assert all(s == ("loaded", None) for s in status.values()), status
    connectors = {c["name"]: c for c in data["connectors"]}
    assert CONNECTORS <= set(connectors), sorted(connectors)
    assert all(c["load_error"] is None for c in connectors.values()), connectors
    # an isolated build has the C modules and not the torch extensions, and says so where users look
    zmq_native = connectors["ZmqAFDConnector"]["native"]
    assert zmq_native["afd_connectors.zmq._zmqwire"] is None
    assert "isolated pip build" in zmq_native["afd_connectors.zmq._zmqsteady"]
    assert "isolated pip build" in connectors["P2pNcclAFDConnector"]["native"]["afd_connectors.p2p._p2pwire"]
    assert data["model_adapters"], "no model adapter registered from the bundled distributions"


def test_every_entry_point_of_the_distributions_loads():
    code = """
import json
from importlib.metadata import entry_points
ours = {"afd-sdk", "afd-models-qwen", "afd-models-deepseek", "afd-connector-nixl"}
loaded = []
for group in ("afd_sdk", "vllm.general_plugins", "console_scripts"):
    for ep in entry_points(group=group):
        if ep.dist is not None and ep.dist.name in ours:
            ep.load()
            loaded.append([group, ep.name, ep.value])
print(json.dumps(loaded))
"""
    loaded = json.loads(_run(str(PY), "-c", code).stdout)
    assert ["vllm.general_plugins", "afd", "afd_sdk.integrations.vllm:register"] in loaded
    assert ["console_scripts", "afd", "afd_sdk.cli:main"] in loaded
    assert {name for group, name, _ in loaded if group == "afd_sdk"} == {"qwen", "deepseek", "nixl"}


def test_afd_demo_matches_native_from_the_wheels():
    out = json.loads(_run(str(VENV / "bin" / "afd"), "demo", "--json", timeout=600).stdout)
    assert out["match"] is True and out["tokens_equal"] is True and out["max_abs_diff"] == 0.0, out
