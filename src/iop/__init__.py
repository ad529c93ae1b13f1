"""IOP Edge: an OpenAI-compatible LLM inference gateway for Kubernetes."""

__version__ = "0.1.0"
