"""The Edge: the OpenAI-compatible API, the provider pool, the node hub and usage metering.

`EdgeServer` (what `iop edge run` starts) is the package's one public name; everything else is
reached by its module. The modules, in layers, highest first; a module imports only from its own
layer or those below (import-linter holds the package to it, `[tool.importlinter]` in
pyproject.toml, and to having no circles):

- `launching`: one process's lifecycle, every part below started and stopped in order;
- `guardmetrics`: the metrics of what the Edge turns away, read from the parts at scrape time;
- the servers: `serving` (the OpenAI API), `admin` (the admin API), `nodehub` (the gRPC server
  Nodes dial) and `uvicornserving` (the HTTP server, with the limits of `httplimits`);
- what they run: `relaying` (one request's run, its retries and fallbacks), `refreshing` (a
  live refresh), `nodesessions` (one connected Node, one run's stream), `localnodes` (the
  nodes placed on the Edge, run in this process), `clientguarding` (what one client may do) and
  `hublimits` (what the hub refuses before a Node is known);
- `enforcing` (`openai.limits[]` at admission), `metering`, `httplimits`;
- the pool's state and HTTP's words: `dispatching`, `retrying`, `authenticating`, `bodies`,
  `httperrors` (the one error -> HTTP mapper) and `redislimits`;
- what imports nothing else of the Edge: values and rules (`errors`, the one exception
  hierarchy; `snapshots`; `hubs`, what the request path needs from the hub, as a Protocol;
  `limiting`; `refreshreports`; `asgi`), `authfailures` (failed authentications per source),
  `configfiles` (reading a config file for a refresh), `peering` (how many Edge replicas share
  the placed nodes' capacity) and `redisclients` (a lean Redis client).
"""

from .launching import EdgeServer

__all__ = ["EdgeServer"]
