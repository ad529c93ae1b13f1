"""IOP Edge: an OpenAI-compatible LLM inference gateway for Kubernetes."""

__all__ = []


#: The version of the distribution (`iop --version`).
__version__ = "0.1.0"
