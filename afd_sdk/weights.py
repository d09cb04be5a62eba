"""Checkpoint tensor names: reading them without loading tensors, and classifying them.

:func:`read_checkpoint` reads names (and byte sizes where known) from a
checkpoint directory (``*.safetensors`` shards, ``model.safetensors.index.json``),
one ``.safetensors`` file (its JSON header only), or a text file with one name
per line. :func:`classify` builds the report that ``afd weights classify``
prints from an adapter's rules (:mod:`afd_sdk.weight_rules`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afd_sdk.adapter import ModelAdapter, WeightRole
from afd_sdk.errors import AFDConfigError

__all__ = ["CheckpointNames", "ClassifyReport", "classify", "read_checkpoint", "read_hf_config"]

_MAX_HEADER = 100 * 1024 * 1024


@dataclass
class CheckpointNames:
    """Tensor names of a checkpoint, with byte sizes where the source has them."""

    names: list[str]
    nbytes: dict[str, int] = field(default_factory=dict)
    config: dict[str, Any] | None = None


def _safetensors_header(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise ValueError(f"header length {n} exceeds {_MAX_HEADER}")
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as exc:
        raise AFDConfigError(
            f"checkpoint file {str(path)!r} is not a readable safetensors file: {exc}", key="path"
        ) from None
    if not isinstance(header, dict):
        raise AFDConfigError(f"checkpoint file {str(path)!r} has a malformed safetensors header", key="path")
    header.pop("__metadata__", None)
    return header


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """Load a HF ``config.json`` (a file, or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise AFDConfigError(f"config {str(p)!r} cannot be read as JSON: {exc}", key="config", value=str(p)) from None
    if not isinstance(data, dict):
        raise AFDConfigError(f"config {str(p)!r} is not a JSON object", key="config", value=str(p))
    return data


def read_checkpoint(path: str | Path) -> CheckpointNames:
    """Names (and sizes) of every tensor under ``path``, reading headers only."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        index = p / "model.safetensors.index.json"
        config = read_hf_config(p) if (p / "config.json").is_file() else None
        if not files and index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            return CheckpointNames(sorted(weight_map), {}, config)
        if not files:
            raise AFDConfigError(
                f"checkpoint directory {str(p)!r} holds no *.safetensors file", key="path", value=str(p)
            )
        out = CheckpointNames([], {}, config)
        for f in files:
            _add_header(out, f)
        return out
    if p.suffix == ".safetensors":
        out = CheckpointNames([], {})
        _add_header(out, p)
        return out
    if p.is_file():
        names = [line.strip() for line in p.read_text().splitlines() if line.strip() and not line.startswith("#")]
        return CheckpointNames(names)
    raise AFDConfigError(
        f"path={str(p)!r} does not exist; expected a checkpoint directory, a .safetensors file or a names file",
        key="path",
        value=str(p),
    )


def _add_header(out: CheckpointNames, f: Path) -> None:
    for name, meta in _safetensors_header(f).items():
        out.names.append(name)
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if isinstance(offsets, list) and len(offsets) == 2:
            out.nbytes[name] = int(offsets[1]) - int(offsets[0])


# --- report ------------------------------------------------------------------


@dataclass
class ClassifyReport:
    architecture: str
    roles: dict[str, str]
    counts: dict[str, int]
    bytes: dict[str, int | None]
    unclassified: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "counts": self.counts,
            "bytes": self.bytes,
            "unclassified": self.unclassified,
            "roles": self.roles,
        }


def classify(
    adapter: ModelAdapter,
    names: Iterable[str],
    nbytes: Mapping[str, int] | None = None,
    *,
    compute_gate_on_attention: bool = False,
    progress: Callable[[int], None] | None = None,
) -> ClassifyReport:
    """Classify every name; unclassified names are listed, never defaulted."""
    nbytes = nbytes or {}
    roles: dict[str, str] = {}
    counts = {r.value: 0 for r in WeightRole}
    sizes: dict[str, int] = {r.value: 0 for r in WeightRole}
    unclassified: list[str] = []
    role_of = adapter.weight_role
    for i, name in enumerate(names):
        role = role_of(name, compute_gate_on_attention=compute_gate_on_attention)
        if role is None:
            unclassified.append(name)
            roles[name] = "unclassified"
            continue
        roles[name] = role.value
        counts[role.value] += 1
        sizes[role.value] += nbytes.get(name, 0)
        if progress is not None and i % 50_000 == 49_999:
            progress(50_000)
    known = bool(nbytes)
    return ClassifyReport(
        adapter.architecture,
        roles,
        {**counts, "unclassified": len(unclassified)},
        {k: (v if known else None) for k, v in sizes.items()},
        unclassified,
    )
