"""afd-sdk adapters for DeepSeek models: V2, V3, V3.2, GLM-MoE-DSA, V4, V4.1."""

__version__ = "0.1.0"
