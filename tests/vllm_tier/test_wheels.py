"""The vLLM plugin from the built wheels (``dist/``, ``scripts/build-wheels.sh``), not from this tree.

The wheels are unpacked with ``pip install --target`` into a directory that goes first on ``PYTHONPATH`` of every
process here (vLLM's engine processes inherit it), so ``afd_sdk``, its ``vllm.general_plugins`` entry point and
the model adapters resolve to the installed wheels; the tier's editable install stays behind them. A wheel that
lacked a package (0.1.0 lacked ``afd_sdk.integrations.vllm``) fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed here; run the tier with scripts/bootstrap-vllm.sh (tests/vllm_tier)"
)

from vllm_aliases import expected_aliases

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "dist"


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory) -> dict[str, str]:
    wheels = sorted(str(p) for p in DIST.glob("afd_*.whl") if "nixl" not in p.name)  # nixl: not in this tier
    if len(wheels) != 3:
        why = f"dist/ holds {len(wheels)} of the 3 wheels this case installs: ./scripts/build-wheels.sh builds them"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    target = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--target",
            str(target),
            *wheels,
        ],
        check=True,
        timeout=300,
    )
    cache = tmp_path_factory.mktemp("vllm-cache")
    return {**os.environ, "PYTHONPATH": str(target), "VLLM_CACHE_ROOT": str(cache), "VLLM_LOGGING_LEVEL": "ERROR"}


def _run(args: list[str], env: dict[str, str], timeout: float) -> str:
    res = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout, cwd="/")
    assert res.returncode == 0, f"rc={res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-4000:]}"
    return res.stdout


def test_load_general_plugins_registers_the_aliases_from_the_wheels(wheel_env):
    code = """
import json
from importlib.metadata import entry_points
import afd_sdk, afd_sdk.integrations.vllm
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm import ModelRegistry
(ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "afd"]
print(json.dumps({"sdk": afd_sdk.__file__, "vllm_pkg": afd_sdk.integrations.vllm.__file__,
                  "dist": str(ep.dist.locate_file("")), "version": ep.dist.version,
                  "aliases": sorted(a for a in ModelRegistry.get_supported_archs() if a.startswith("AFD"))}))
"""
    out = json.loads(_run([sys.executable, "-c", code], wheel_env, 300).splitlines()[-1])
    target = wheel_env["PYTHONPATH"]
    assert out["sdk"].startswith(target) and out["vllm_pkg"].startswith(target), out
    assert out["dist"].startswith(target) and out["version"] == "0.2.0", out
    # every adapter's alias (test_vllm_tier.py's editable-install twin of this check runs with -m slow)
    assert set(out["aliases"]) == expected_aliases() and len(out["aliases"]) == 11, out["aliases"]


def test_afd_demo_engine_vllm_matches_from_the_wheels(wheel_env):
    """`afd demo --engine vllm --json` on DeepSeek-V2 (MLA), from the wheels: the summary's contract and a match."""
    argv = [
        sys.executable,
        "-m",
        "afd_sdk.cli",
        "demo",
        "--engine",
        "vllm",
        "--arch",
        "DeepseekV2ForCausalLM",
        "--json",
    ]
    result = json.loads(_run(argv, wheel_env, 900))
    assert {"match", "tokens_equal", "max_abs_diff", "ranks"} <= result.keys() and result["engine"] == "vllm", result
    assert not result.get("errors"), result["errors"]
    assert result["match"] is True and result["tokens_equal"] is True, result
    assert len(result["ranks"]) == 1 and result["ranks"][0]["goodbye_sent"] is True, result["ranks"]
