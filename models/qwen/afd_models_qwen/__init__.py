"""afd-sdk adapters for Qwen MoE models: Qwen3-MoE, Qwen3.5-MoE (text), Qwen3-Next."""

__version__ = "0.1.0"
