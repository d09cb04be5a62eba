#!/usr/bin/env bash
# Build every distribution as users get it: an sdist, then a wheel built from that sdist in an isolated build
# (what `pip install afd-sdk` does from PyPI), into dist/. Distributions: afd-sdk, afd-models-qwen,
# afd-models-deepseek, afd-connector-nixl. An isolated build has no torch to compile against, so afd-sdk's
# wheel carries the C modules (_shmring, _zmqwire) and not the torch extensions (docs/connectors.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
rm -rf dist
LOG="$(mktemp)"
# the sdists are built from a copy of the tree: a build writes *.egg-info beside the sources, and the test suite
# may be running from this tree meanwhile (scripts/test.sh builds the wheels beside it)
SRC="$(mktemp -d)"
trap 'rm -rf "$LOG" "$SRC"' EXIT
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    # the files git would commit (tracked, and untracked but not ignored), listed before anything is copied:
    # reading the tree's directories instead raced scripts/bootstrap-vllm.sh, whose editable installs write
    # *.egg-info beside them meanwhile (tar: "file changed as we read it", exit 1)
    git ls-files -z --cached --others --exclude-standard | tar -c --null --ignore-failed-read -T - | tar -x -C "$SRC"
else
    tar -c --exclude='./.venv*' --exclude=./dist --exclude=./build --exclude=./.git --exclude='*.egg-info' \
        --exclude=__pycache__ --exclude='*.so' --exclude=_torch_build.json --exclude=.pytest_cache . | tar -x -C "$SRC"
fi
for d in . models/qwen models/deepseek connectors/nixl; do
    "$PY" -m build --sdist --outdir dist "$SRC/$d" >"$LOG" 2>&1 || { cat "$LOG" >&2; echo "error: sdist of $d" >&2; exit 1; }
done
for sdist in dist/*.tar.gz; do
    "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir dist "$sdist"
done
