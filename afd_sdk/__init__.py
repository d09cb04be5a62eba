"""afd-sdk: the open, pluggable SDK for Attention–FFN Disaggregation of MoE inference.

The public surface is small: the hook marker, the contracts, the config and
the errors. Importing this package imports no CUDA, NCCL, Ascend or vLLM code.
"""

from __future__ import annotations

from afd_sdk.adapter import Binding, Deployment, ExtraSpec, ModelAdapter, MoELayout, WeightRole, afd_alias
from afd_sdk.config import AFDConfig, parse_config, parse_extra_config
from afd_sdk.connector import AFDConnector, ConnectorBase, ConnectorCapabilities, ConnectorContext, ControlPlane
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
from afd_sdk.hookspecs import hookimpl
from afd_sdk.metadata import ForwardMetadata, MetadataProvider
from afd_sdk.proxy import FFNOutput, TensorOutput, TupleOutput
from afd_sdk.wire import (
    A2FPayload,
    ControlPayload,
    F2APayload,
    HandshakeReject,
    ModelFingerprint,
    TransferMetadata,
)

__version__ = "0.1.0"

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
    "TupleOutput",
    "UnclassifiedWeightError",
    "UnknownNameError",
    "UnsupportedFeatureError",
    "WeightRole",
    "WireFormatError",
    "__version__",
    "afd_alias",
    "hookimpl",
    "parse_config",
    "parse_extra_config",
]
