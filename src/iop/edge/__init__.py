"""The Edge: the OpenAI-compatible API, the provider pool, the node hub and usage metering.

Its rooms, highest first; a room imports only from those below it (the import contract in
pyproject.toml; docs/architecture.md draws them):

- `server`: one process, every part started and stopped in order; `guardmetrics`: the metrics
  of what the Edge turns away;
- `http`: requests in and out; `refresh`: a live refresh; `limits`: `openai.limits[]`;
- `pool`: where a request runs; `hub`: the Nodes, remote or placed on the Edge;
- a request's values: `errors` (the one exception hierarchy), `bodies` (request bodies: parsed,
  the generation policy, the token estimate), `bodymodels` (what a body must be, by hand and by
  the pydantic models), `bodybounds` (its bulk, bounded before and as it is parsed),
  `authenticating` (API keys to principals) and `authfailures` (failed keys per address).
"""

from .server import EdgeServer

__all__ = ["EdgeServer"]
