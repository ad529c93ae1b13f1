"""The Edge: the OpenAI-compatible API, the provider pool, the node hub and usage metering.

`EdgeServer` (what `iop edge run` starts) is the package's one public name; everything else is
reached by its module. The modules, lowest layer first (each imports only from the layers before
its own):

- values and rules, no I/O: `errors` (the one exception hierarchy), `snapshots` (the pool as
  the config describes it), `limiting` (the rules of `openai.limits[]`), `hubs` (what the
  request path needs from the hub, a Protocol), `refreshreports`, `asgi` (the raw apps'
  shared pieces), `configfiles` (reading a config file for a refresh);
- HTTP's words and the pool's state: `httperrors` (the one error -> HTTP mapper), `httplimits`,
  `hublimits`, `authfailures`, `authenticating`, `bodies`, `dispatching`, `retrying`,
  `redisclients` and `redislimits`;
- the request path: `enforcing` (limits at admission), `metering`, `relaying` (one request's
  run, its retries and fallbacks), `serving` (the OpenAI API), `clientguarding` (what one
  client may do);
- the node hub: `nodesessions` (one connected Node, one run's stream) and `nodehub` (the gRPC
  server);
- the live refresh: `refreshing` and the admin API `admin`; the servers: `uvicornserving` (the
  HTTP server) and `guardmetrics`;
- `launching`: one process's lifecycle, every part above started and stopped in order.
"""

from .launching import EdgeServer

__all__ = ["EdgeServer"]
