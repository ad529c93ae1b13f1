"""IOP Edge: an OpenAI-compatible LLM inference gateway for Kubernetes.

Its packages, highest layer first (docs/architecture.md, "Layers"; import-linter holds the order):

- `cli`: the `iop` command line, thin entry points;
- `edge`: the Edge (the OpenAI API, the provider pool, the node hub); `node`: the Node agent;
  `operator`: the EdgeConfig operator; `processes`: `iop` commands started as child processes;
- `providers`: what runs a request on a model server, in a Node or inside the Edge;
- `wire`: what the Edge and the Node say to each other; `verdicts`: a change judged by what it
  served (the Edge's canaries, the operator's Edge restarts); `fakes`: deterministic stand-ins;
- `edgeconfig`: the config model (pure); `aiokits`: asyncio building blocks; `tracing`:
  OpenTelemetry traces, off unless configured.
"""

__all__ = []


#: The version of the distribution (`iop --version`).
__version__ = "0.1.0"
