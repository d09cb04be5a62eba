"""The exception hierarchy users catch.

Everything afd-sdk raises on purpose derives from :class:`AFDError`. Each error
carries one message that names the key (or component), the value and what
would be accepted, so a log line is enough to fix the problem.
"""

from __future__ import annotations

__all__ = [
    "AFDConfigError",
    "AFDError",
    "ConnectorError",
    "DrainedError",
    "HandshakeError",
    "PeerLostError",
    "PluginLoadError",
    "PluginTargetError",
    "RegistrationError",
    "TopologyError",
    "UnclassifiedWeightError",
    "UnknownNameError",
    "UnsupportedFeatureError",
    "WireFormatError",
]


class AFDError(Exception):
    """Base class of every error afd-sdk raises on purpose."""


class AFDConfigError(AFDError, ValueError):
    """A configuration value is invalid. Raised before any resource exists.

    ``key`` is the dotted key path (``"afd.port"``), ``value`` the offending
    value; both are also in the message.
    """

    def __init__(self, message: str, *, key: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.key = key
        self.value = value


class UnknownNameError(AFDConfigError, LookupError):
    """A connector, adapter or provider name is not registered."""


class TopologyError(AFDConfigError):
    """The requested Attention/FFN rank layout cannot be built."""


class UnsupportedFeatureError(AFDConfigError):
    """A model adapter cannot support a requested deployment feature."""

    def __init__(self, architecture: str, feature: str, value: object, supported: str) -> None:
        super().__init__(
            f"{architecture} does not support {feature}={value!r} under AFD; supported: {supported}",
            key=feature,
            value=value,
        )
        self.architecture = architecture
        self.feature = feature
        self.supported = supported


class UnclassifiedWeightError(AFDError, KeyError):
    """A checkpoint tensor name matches no weight-role rule of its adapter."""

    def __init__(self, architecture: str, names: list[str]) -> None:
        shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
        super().__init__(f"{architecture}: {len(names)} tensor name(s) match no weight-role rule: {shown}")
        self.architecture = architecture
        self.names = names

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class PluginLoadError(AFDError, ImportError):
    """A plugin failed to import or its hook raised; carries the original failure."""

    def __init__(
        self,
        message: str,
        *,
        plugin: str | None = None,
        distribution: str | None = None,
        version: str | None = None,
        cause: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.distribution = distribution
        self.version = version
        self.cause = cause
        if cause is not None:
            self.__cause__ = cause


class RegistrationError(AFDError, ValueError):
    """A plugin registered a duplicate name, a clashing alias or a bad target."""


class PluginTargetError(RegistrationError, TypeError):
    """A registered target resolves to something that is not the registry's base class.

    Raised when the name is first resolved (targets are imported lazily); the
    message names the component, the plugin, the target and the expected base.
    """


class WireFormatError(AFDError, ValueError):
    """Bytes or a header received from a peer do not decode to what was expected."""


class ConnectorError(AFDError, RuntimeError):
    """A connector was used wrongly (not initialised, wrong role, shape mismatch)."""


class HandshakeError(ConnectorError):
    """The two roles disagree on protocol, model or topology at ``init()``.

    ``field`` names what differs; ``attention`` and ``ffn`` hold both sides' values.
    """

    def __init__(self, field: str, attention: object, ffn: object) -> None:
        super().__init__(f"handshake mismatch on {field}: attention has {attention}, ffn has {ffn}")
        self.field = field
        self.attention = attention
        self.ffn = ffn


class PeerLostError(ConnectorError):
    """The peer exited or stalled past ``timeout_s`` while this side waited on it."""


class DrainedError(ConnectorError):
    """The FFN side was drained (``request_stop``) while it waited for its attention peers: an orderly end.

    Raised by a control plane's rendezvous; the runtime ends that world cleanly (no steps served, exit 0).
    """
