"""llmd: a multi-tenant LLM inference service in front of vLLM."""

__version__ = "0.1.0"
