"""afd-connector-nixl: the NIXL transport for afd-sdk, installed like any third-party connector plugin."""

__version__ = "0.1.0"
