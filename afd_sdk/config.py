"""``AFDConfig``: the ``additional_config["afd"]`` mapping, parsed strictly.

Canonical keys are exactly upstream vLLM AFD's; the aliases users already
type (``afd_role``, ``afd_connector``, ``afd_host``, ``afd_port``, ``async``)
normalise to them. Every problem is one :class:`AFDConfigError` that names the
key path, the value and what is accepted, raised before any resource exists.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

from afd_sdk.errors import AFDConfigError

__all__ = ["ROLES", "AFDConfig", "config_mapping", "did_you_mean", "parse_config", "parse_extra_config"]

ROLES = ("attention", "ffn")
Role = Literal["attention", "ffn"]

ALIASES: dict[str, str] = {
    "afd_role": "role",
    "afd_connector": "connector",
    "afd_host": "host",
    "afd_port": "port",
    "async": "async_dp",
    "afd_server_rank": "server_rank",
}

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


class AFDConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One role's AFD configuration, as normalised from ``additional_config["afd"]``.

    Construct it with :func:`parse_config`; direct construction skips validation.
    """

    role: Role
    connector: str = "ZmqAFDConnector"
    host: str = "127.0.0.1"
    port: int = 29650
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    compute_gate_on_attention: bool = False
    async_dp: bool = False
    connector_extra_config: dict[str, Any] = msgspec.field(default_factory=dict)
    timeout_s: float = 60.0
    #: how long a role waits for its peers to appear at start-up (rendezvous and handshake), either side first
    connect_timeout_s: float = 1800.0
    num_stages: int = 1
    #: this process's rank within its role where no launcher says it (vLLM's data-parallel rank wins when DP > 1)
    server_rank: int = 0
    #: the network interface (``eth1``) the process groups (Gloo, NCCL) of p2p and CAM use; ``None``: the one whose
    #: address routes to ``host`` (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, where set, win over both)
    interface: str | None = None
    #: the port of this process's ``/metrics``, ``/healthz`` and ``/readyz`` endpoint; ``None``: no endpoint
    metrics_port: int | None = None
    #: the address that endpoint binds; ``None``: this host's address on the route to ``host`` (``host`` if local)
    metrics_host: str | None = None
    #: processes serving each FFN rank with the same weights (``afd ffn serve --replica K``); an attention rank
    #: uses one and fails over to the next when it is lost (docs/operations.md)
    ffn_replicas: int = 1
    #: replica ``K`` of the world at ``port`` is the world at ``port + K * replica_port_stride``, then its beacon
    #: ports (one per FFN rank, :mod:`afd_sdk.runtime.replica_beacon`)
    replica_port_stride: int = 32
    #: FFN rank ``f``'s address (an FFN pool across hosts): its control and data sockets bind ``ffn_hosts[f]``;
    #: ``None``: every FFN rank on ``host``. ``host`` defaults to ``ffn_hosts[0]`` when it is not given
    ffn_hosts: tuple[str, ...] | None = None
    #: replica ``K``'s address (replicas on different hosts survive the loss of a host or its link): its world
    #: binds where ``host`` would; ``None``: every replica on ``host``, which defaults to ``replica_hosts[0]``
    replica_hosts: tuple[str, ...] | None = None

    def ffn_host(self, ffn_rank: int) -> str:
        """The address FFN rank ``ffn_rank`` listens on: ``ffn_hosts[ffn_rank]``, else ``host``.

        Called by connectors and control planes wherever an FFN rank's socket is bound or connected to.
        """
        return self.host if self.ffn_hosts is None else self.ffn_hosts[ffn_rank]

    def to_dict(self) -> dict[str, Any]:
        """Canonical JSON-ready mapping (what ``afd config check`` prints)."""
        return msgspec.to_builtins(self)

    def replace(self, **changes: Any) -> AFDConfig:
        """A validated copy with ``changes`` applied (keys as in the mapping)."""
        return parse_config({**self.to_dict(), **changes})


_FIELDS: tuple[str, ...] = AFDConfig.__struct_fields__


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """``"; did you mean 'x'?"`` for the closest choice, or ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _err(key: str, value: object, accepted: str) -> AFDConfigError:
    return AFDConfigError(f"afd.{key}={value!r} is invalid; expected {accepted}", key=f"afd.{key}", value=value)


def _as_bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _err(key, value, "a bool (true/false, 1/0, yes/no, on/off)")


def _as_int(key: str, value: object, *, lo: int, hi: int) -> int:
    out: int | None = None
    if isinstance(value, bool):
        out = None
    elif isinstance(value, int):
        out = value
    elif isinstance(value, float) and value.is_integer():
        out = int(value)
    elif isinstance(value, str):
        try:
            out = int(value.strip(), 10)
        except ValueError:
            out = None
    if out is None or not lo <= out <= hi:
        raise _err(key, value, f"an integer in [{lo}, {hi}]")
    return out


def _as_float(key: str, value: object, *, lo: float, hi: float) -> float:
    out: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value.strip())
        except ValueError:
            out = None
    if out is None or math.isnan(out) or not lo < out <= hi:
        raise _err(key, value, f"a number of seconds in ({lo:g}, {hi:g}]")
    return out


def _as_host(value: object, key: str = "host") -> str:
    if not isinstance(value, str) or not value.strip():
        raise _err(key, value, "an IP address or host name, e.g. '127.0.0.1'")
    host = value.strip()
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    labels = host.split(".")
    ok = len(host) <= 253 and all(
        0 < len(lab) <= 63 and lab.replace("-", "").isalnum() and lab.isascii() and not lab.startswith("-")
        for lab in labels
    )
    if not ok:
        raise _err(key, value, "an IP address or host name, e.g. '127.0.0.1'")
    return host


def _as_hosts(key: str, value: object, per: str) -> tuple[str, ...]:
    """A list of addresses, one ``per`` item; a comma-separated string (``"10.0.0.1,10.0.0.2"``) for command lines."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise _err(key, value, f"a non-empty list of IP addresses or host names, one per {per}")
    return tuple(_as_host(h, key=f"{key}[{i}]") for i, h in enumerate(items))


def config_mapping(source: object) -> Mapping[str, Any]:
    """Turn any accepted input into the ``afd`` mapping itself.

    Accepts a mapping (the AFD mapping, or vLLM's envelope ``{"afd": {...}}``),
    a JSON string, a path to a JSON file, or an object with vLLM's
    ``additional_config`` attribute (a ``VllmConfig``).
    """
    if hasattr(source, "additional_config") and not isinstance(source, (str, bytes, Mapping)):
        source = source.additional_config or {}
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, bytes):
        try:
            source = source.decode()
        except UnicodeDecodeError as exc:
            raise AFDConfigError(f"afd config bytes are not UTF-8: {exc}", key="afd") from None
    if isinstance(source, str):
        text = source.strip()
        if not text.startswith(("{", "[")):
            path = Path(text)
            if not path.is_file():
                raise AFDConfigError(
                    f"afd config {source!r} is neither a JSON object nor a path to a JSON file", key="afd", value=source
                )
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise AFDConfigError(f"afd config file {source!r} cannot be read: {exc}", key="afd") from None
        try:
            source = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise AFDConfigError(f"afd config is not valid JSON: {exc}", key="afd") from None
    if not isinstance(source, Mapping):
        raise AFDConfigError(f"afd config must be a JSON object, got {type(source).__name__}", key="afd", value=source)
    if "afd" in source:
        inner = source["afd"]
        if not isinstance(inner, Mapping):
            raise _err("", inner, "a JSON object under the 'afd' key") from None
        return inner
    return source


def parse_config(source: object) -> AFDConfig:
    """Parse and validate one role's AFD config (inputs: :func:`config_mapping`); an ``AFDConfig`` passes as is."""
    if isinstance(source, AFDConfig):
        return source
    raw = config_mapping(source)
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise AFDConfigError(f"afd config key {key!r} is not a string", key="afd", value=key)
        canonical = ALIASES.get(key, key)
        if canonical not in _FIELDS:
            accepted = sorted(_FIELDS) + sorted(ALIASES)
            raise AFDConfigError(
                f"afd.{key} is not a known key{did_you_mean(key, accepted)} (accepted: {', '.join(sorted(_FIELDS))})",
                key=f"afd.{key}",
                value=value,
            )
        if canonical in values:
            raise AFDConfigError(
                f"afd.{origin[canonical]} and afd.{key} both set {canonical!r}; give only {canonical!r}",
                key=f"afd.{key}",
                value=value,
            )
        values[canonical] = value
        origin[canonical] = key

    if "role" not in values:
        raise AFDConfigError("afd.role is required; expected one of 'attention', 'ffn'", key="afd.role")
    out: dict[str, Any] = {}
    role = values["role"]
    if not isinstance(role, str) or role.strip().lower() not in ROLES:
        raise _err("role", role, "one of 'attention', 'ffn'")
    out["role"] = role.strip().lower()
    if "connector" in values:
        conn = values["connector"]
        if not isinstance(conn, str) or not conn.strip():
            raise _err("connector", conn, "a registered connector name, e.g. 'ZmqAFDConnector' (see `afd plugins`)")
        out["connector"] = conn.strip()
    if "host" in values:
        out["host"] = _as_host(values["host"])
    if values.get("ffn_hosts") is not None:
        out["ffn_hosts"] = _as_hosts("ffn_hosts", values["ffn_hosts"], "FFN rank")
        out.setdefault("host", out["ffn_hosts"][0])
    if values.get("replica_hosts") is not None:
        out["replica_hosts"] = _as_hosts("replica_hosts", values["replica_hosts"], "replica")
        if "ffn_hosts" in out:
            raise _err(
                "replica_hosts",
                list(out["replica_hosts"]),
                "unset with afd.ffn_hosts (a replica's FFN ranks on hosts of their own is not supported); "
                "replica_hosts[K] holds every FFN rank of replica K",
            )
        if out.setdefault("host", out["replica_hosts"][0]) != out["replica_hosts"][0]:
            raise _err(
                "host",
                out["host"],
                f"replica 0's address, afd.replica_hosts[0]={out['replica_hosts'][0]!r}, or unset: with "
                "afd.replica_hosts each replica's world binds its own entry",
            )
    if "port" in values:
        out["port"] = _as_int("port", values["port"], lo=1, hi=65535)
    for key in ("num_attention_ranks", "num_ffn_ranks"):
        if key in values:
            out[key] = _as_int(key, values[key], lo=1, hi=65536)
    if "server_rank" in values:
        out["server_rank"] = _as_int("server_rank", values["server_rank"], lo=0, hi=65535)
    if values.get("interface") is not None:
        iface = values["interface"]
        # Linux interface names: 1..15 bytes, no '/', no whitespace (IFNAMSIZ - 1)
        if not isinstance(iface, str) or not 0 < len(iface.strip()) <= 15 or any(c in iface.strip() for c in "/ \t:"):
            raise _err("interface", iface, "a network interface name such as 'eth0' (1-15 characters, no '/', ':')")
        out["interface"] = iface.strip()
    if values.get("metrics_port") is not None:
        out["metrics_port"] = _as_int("metrics_port", values["metrics_port"], lo=1, hi=65535)
    if values.get("metrics_host") is not None:
        out["metrics_host"] = _as_host(values["metrics_host"], key="metrics_host")
    if "num_stages" in values:
        out["num_stages"] = _as_int("num_stages", values["num_stages"], lo=1, hi=64)
    if "ffn_replicas" in values:
        out["ffn_replicas"] = _as_int("ffn_replicas", values["ffn_replicas"], lo=1, hi=64)
    if "replica_port_stride" in values:
        out["replica_port_stride"] = _as_int("replica_port_stride", values["replica_port_stride"], lo=1, hi=4096)
    replicas, stride = out.get("ffn_replicas", 1), out.get("replica_port_stride", 32)
    if replicas > 1:
        # a world's ports: zmq, the most, uses F x (1 + num_stages) from afd.port (p2p F + 1, its store); then
        # one beacon port per FFN rank (afd_sdk.runtime.replica_beacon)
        span = out.get("num_ffn_ranks", 1) * (2 + out.get("num_stages", 1))
        if stride < span:
            raise _err(
                "replica_port_stride",
                stride,
                f"at least {span} with ffn_replicas > 1: num_ffn_ranks x (2 + num_stages) ports per replica (its "
                "world's and one beacon port per FFN rank), so the replicas' ports do not overlap",
            )
        last = out.get("port", 29650) + (replicas - 1) * stride + span - 1
        if last > 65535:
            raise _err(
                "ffn_replicas",
                replicas,
                f"a count whose last replica's last port, afd.port + (ffn_replicas - 1) * afd.replica_port_stride "
                f"+ {span - 1} = {last}, is at most 65535",
            )
    hosts = out.get("ffn_hosts")
    if hosts is not None and len(hosts) != out.get("num_ffn_ranks", 1):
        raise _err(
            "ffn_hosts",
            list(hosts),
            f"one address per FFN rank: {out.get('num_ffn_ranks', 1)} (afd.num_ffn_ranks), FFN rank f at ffn_hosts[f]",
        )
    per_replica = out.get("replica_hosts")
    if per_replica is not None:
        if len(per_replica) != out.get("ffn_replicas", 1):
            raise _err(
                "replica_hosts",
                list(per_replica),
                f"one address per replica: {out.get('ffn_replicas', 1)} (afd.ffn_replicas), replica K at "
                "replica_hosts[K]",
            )
    for key in ("compute_gate_on_attention", "async_dp"):
        if key in values:
            out[key] = _as_bool(key, values[key])
    for key in ("timeout_s", "connect_timeout_s"):
        if key in values:
            out[key] = _as_float(key, values[key], lo=0.0, hi=86400.0)
    if "connector_extra_config" in values:
        extra = values["connector_extra_config"]
        if isinstance(extra, str):
            try:
                extra = json.loads(extra) if extra.strip() else {}
            except (json.JSONDecodeError, RecursionError):
                raise _err("connector_extra_config", extra, "a JSON object") from None
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
            raise _err("connector_extra_config", extra, "a JSON object with string keys")
        out["connector_extra_config"] = dict(extra)
    return AFDConfig(**out)


S = TypeVar("S", bound=msgspec.Struct)


def parse_extra_config(schema: type[S], raw: Mapping[str, Any], *, connector: str) -> S:
    """Convert ``connector_extra_config`` into a connector's own closed schema.

    Connectors call this from ``parse_extra_config``. ``schema`` should be a
    ``msgspec.Struct`` with ``forbid_unknown_fields=True``; string values are
    coerced to bool/int/float where the field asks for one.
    """
    fields = schema.__struct_fields__
    for key in raw:
        if key not in fields:
            raise AFDConfigError(
                f"afd.connector_extra_config.{key} is not accepted by {connector}{did_you_mean(key, fields)} "
                f"(accepted: {', '.join(fields) or 'no keys'})",
                key=f"afd.connector_extra_config.{key}",
                value=raw[key],
            )
    try:
        return msgspec.convert(dict(raw), schema, strict=False)
    except msgspec.ValidationError as exc:
        # msgspec says e.g. "Expected `int`, got `str` - at `$.port`"
        msg = str(exc)
        path = msg.rsplit("at `$.", 1)[-1].rstrip("`") if "at `$." in msg else ""
        key = f"afd.connector_extra_config.{path}" if path else "afd.connector_extra_config"
        value = raw.get(path.split(".")[0].split("[")[0]) if path else dict(raw)
        raise AFDConfigError(f"{key}={value!r} is invalid for {connector}: {msg}", key=key, value=value) from None
