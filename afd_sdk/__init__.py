"""afd-sdk: the open, pluggable SDK for Attention–FFN Disaggregation of MoE inference.

The public surface is small: the hook marker, the contracts, the config, the
errors, and what a model-adapter author needs (the adapter lookup, the weight
rules, the transformers binding, the FFN-output mapping). Importing this
package imports torch, and no transformers, CUDA, NCCL, Ascend or vLLM code.
"""

from __future__ import annotations

from afd_sdk._compat import install as _install_moved_modules
from afd_sdk.adapter import (
    Binding,
    Deployment,
    ExtraSpec,
    ModelAdapter,
    MoELayout,
    adapter_plugin,
    afd_alias,
    register_adapter,
)
from afd_sdk.capabilities import ConnectorCapabilities
from afd_sdk.config import AFDConfig, parse_config, parse_extra_config
from afd_sdk.connector import AFDConnector, ConnectorBase, ConnectorContext, ControlPlane
from afd_sdk.dispatch import AsyncDispatchConnector, FFNWorkItem
from afd_sdk.errors import (
    AFDConfigError,
    AFDError,
    ConnectorError,
    HandshakeError,
    PeerLostError,
    PluginLoadError,
    PluginTargetError,
    RegistrationError,
    TopologyError,
    UnclassifiedWeightError,
    UnknownNameError,
    UnsupportedFeatureError,
    WireFormatError,
)
from afd_sdk.ffn_output import FFNOutput, TensorOutput, TupleOutput
from afd_sdk.hookspecs import hookimpl
from afd_sdk.integrations.transformers import TransformersBinding
from afd_sdk.metadata import ForwardMetadata, MetadataProvider
from afd_sdk.plugins import adapter_class, adapter_for
from afd_sdk.version import __version__
from afd_sdk.weight_rules import LayerRules, WeightRole
from afd_sdk.wire import (
    A2FPayload,
    ControlPayload,
    F2APayload,
    HandshakeReject,
    ModelFingerprint,
    TransferMetadata,
)

__all__ = [
    "A2FPayload",
    "AFDConfig",
    "AFDConfigError",
    "AFDConnector",
    "AFDError",
    "AsyncDispatchConnector",
    "Binding",
    "ConnectorBase",
    "ConnectorCapabilities",
    "ConnectorContext",
    "ConnectorError",
    "ControlPayload",
    "ControlPlane",
    "Deployment",
    "ExtraSpec",
    "F2APayload",
    "FFNOutput",
    "FFNWorkItem",
    "ForwardMetadata",
    "HandshakeError",
    "HandshakeReject",
    "LayerRules",
    "MetadataProvider",
    "MoELayout",
    "ModelAdapter",
    "ModelFingerprint",
    "PeerLostError",
    "PluginLoadError",
    "PluginTargetError",
    "RegistrationError",
    "TensorOutput",
    "TopologyError",
    "TransferMetadata",
    "TransformersBinding",
    "TupleOutput",
    "UnclassifiedWeightError",
    "UnknownNameError",
    "UnsupportedFeatureError",
    "WeightRole",
    "WireFormatError",
    "__version__",
    "adapter_class",
    "adapter_for",
    "adapter_plugin",
    "afd_alias",
    "hookimpl",
    "parse_config",
    "parse_extra_config",
    "register_adapter",
]

_install_moved_modules()  # the deprecated import paths of moved modules (afd_sdk._compat, docs/api.md)
