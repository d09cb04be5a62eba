"""The public API check: the code matches api/public-api.json, docs/api.md lists it, and the check can fail."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("api_snapshot", ROOT / "scripts" / "api_snapshot.py")
api_snapshot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(api_snapshot)


def test_the_code_matches_the_committed_snapshot():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "api_snapshot.py")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_a_removed_or_changed_public_name_is_reported():
    committed = json.loads(api_snapshot.SNAPSHOT.read_text())
    live = json.loads(json.dumps(committed))
    del live["python"]["afd_sdk.errors"]["TopologyError"]
    live["python"]["afd_sdk.topology"]["even_blocks"]["signature"] = "(total: 'int') -> 'tuple'"
    live["metrics"].remove("afd_ffn_batch_tokens")
    diff = api_snapshot.differences(committed, live)
    assert any(d.startswith("removed: python/afd_sdk.errors/TopologyError/kind") for d in diff), diff
    assert any(d.startswith("changed: python/afd_sdk.topology/even_blocks/signature") for d in diff), diff
    assert any(d.startswith("changed: metrics") for d in diff), diff


def test_a_broken_snapshot_fails_the_check(tmp_path):
    broken = json.loads(api_snapshot.SNAPSHOT.read_text())
    broken["python"]["afd_sdk.errors"]["NoSuchError"] = {"kind": "class", "bases": [], "members": {}}
    path = tmp_path / "api.json"
    path.write_text(json.dumps(broken))
    assert api_snapshot.main(["--snapshot", str(path)]) == 1


def test_docs_api_lists_every_public_name_with_its_module():
    docs = (ROOT / "docs" / "api.md").read_text()
    committed = json.loads(api_snapshot.SNAPSHOT.read_text())
    rows = {line.split("|")[1].strip(" `"): line for line in docs.splitlines() if line.startswith("| `")}
    for module, names in committed["python"].items():
        assert module in rows, f"docs/api.md has no row for {module}"
        for name in names:
            assert f"`{name}`" in rows[module], f"docs/api.md does not list {module}.{name}"
    for key in committed["config_keys"] + committed["metrics"]:
        assert f"`{key}`" in docs, key
