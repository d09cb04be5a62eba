"""The afd-sdk extension contract, on one page.

A plugin is a module (or object) with functions marked ``@afd_sdk.hookimpl``
whose names are the hooks below. Install it as a distribution with an entry
point in group ``afd_sdk``::

    [project.entry-points.afd_sdk]
    my_rdma = "my_rdma_afd.plugin"

Built-in connectors and providers register through these same hooks (see
``afd_sdk.plugins.DEFAULT_PLUGINS``); nothing built-in is special-cased.

Registration hooks are called once per plugin when the plugin manager loads
(process start-up, ``afd`` CLI start, vLLM's ``register()``), never on the hot
path. They receive a ``register`` callable and must only call it: no sockets,
no device work, no heavy imports. A target may be the class itself or a lazy
``"package.module:Class"`` string resolved on first use — prefer the string so
listing plugins imports no transport or framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import pluggy

if TYPE_CHECKING:
    from afd_sdk.config import AFDConfig

__all__ = ["AFDHookSpecs", "Register", "hookimpl", "hookspec"]

PROJECT = "afd_sdk"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class Register(Protocol):
    """The ``register`` callable passed to every ``afd_register_*`` hook."""

    def __call__(self, name: str, target: object, *, aliases: tuple[str, ...] = ()) -> None:
        """Register ``target`` (class or ``"module:attr"``) under ``name`` and ``aliases``.

        Raises ``RegistrationError`` when ``name`` or an alias is taken; the
        plugin manager records that against the calling plugin.
        """


class AFDHookSpecs:
    """Hook specifications; pluggy reads the method signatures."""

    @hookspec
    def afd_register_connectors(self, register: Register) -> None:
        """Register :class:`~afd_sdk.connector.AFDConnector` subclasses.

        Called once per plugin at load. ``name`` is the canonical name users put
        in ``afd.connector`` (keep upstream names such as ``P2pNcclAFDConnector``);
        ``aliases`` are short names (``"p2p"``). The class is checked against
        ``AFDConnector`` when first resolved.
        """

    @hookspec
    def afd_register_model_adapters(self, register: Register) -> None:
        """Register :class:`~afd_sdk.adapter.ModelAdapter` subclasses.

        ``name`` is a checkpoint architecture name the adapter handles
        (``Qwen3MoeForCausalLM``); register once per architecture. The AFD alias
        ``AFD<arch>`` is derived, not registered here.
        """

    @hookspec
    def afd_register_metadata_providers(self, register: Register) -> None:
        """Register :class:`~afd_sdk.metadata.MetadataProvider` subclasses.

        ``name`` is what the runtime asks for (``"contextvar"``, ``"vllm"``).
        """

    @hookspec
    def afd_validate_config(self, config: AFDConfig) -> None:
        """Veto a config this plugin knows cannot work.

        Called after the config parsed and its connector resolved, before any
        resource exists. Raise ``AFDConfigError`` (or a subclass) naming the
        key, the value and what would be accepted; return ``None`` to accept.
        Every plugin's implementation is called; the first error wins.
        """
