"""The Edge: the OpenAI-compatible API, the provider pool, the node hub and usage metering.

Layers inside the package, lowest first: `errors` and `snapshots` (pure data from the config),
`dispatching` (the pool's live state), `authenticating`, `bodies`, `metering`, `statuses`, the
hub seam `runs` (and the hub itself, `nodehub`), `retrying` (what is retried, the retry
budget), `relaying` (one request's run, its retries and fallbacks), `serving` (the
ASGI app), the live refresh (`refreshes`, `refreshing`, and the admin API `admin`) and
`launching` (one process's lifecycle).
"""

from .admin import AdminApp, AdminAuth, AdminAuthError
from .authenticating import ANONYMOUS, Authenticator, Principal
from .dispatching import Dispatcher, Lease
from .errors import (
    BadRequest,
    EdgeError,
    HeadersTooLarge,
    HeaderTimeout,
    InternalError,
    MalformedRequest,
    MethodNotAllowed,
    ModelNotFound,
    NoProvider,
    PayloadTooLarge,
    QueueFull,
    QueueTimeout,
    RouteNotFound,
    TooManyConnections,
    Unauthorized,
    UpstreamError,
)
from .httplimits import HttpLimits
from .hubs import Hub, NodeRuns
from .launching import EdgeServer
from .metering import Metrics
from .nodehub import NodeHub
from .refreshing import ConfigPush, Refresher
from .refreshreports import NodePush, RefreshReport
from .serving import EdgeApp
from .snapshots import Candidate, ModelRoute, PoolSnapshot, ProviderLimits

__all__ = [
    "ANONYMOUS",
    "AdminApp",
    "AdminAuth",
    "AdminAuthError",
    "Authenticator",
    "BadRequest",
    "Candidate",
    "ConfigPush",
    "Dispatcher",
    "EdgeApp",
    "EdgeError",
    "EdgeServer",
    "HeaderTimeout",
    "HeadersTooLarge",
    "HttpLimits",
    "Hub",
    "InternalError",
    "Lease",
    "MalformedRequest",
    "MethodNotAllowed",
    "Metrics",
    "ModelNotFound",
    "ModelRoute",
    "NoProvider",
    "NodeHub",
    "NodePush",
    "NodeRuns",
    "PayloadTooLarge",
    "PoolSnapshot",
    "Principal",
    "ProviderLimits",
    "QueueFull",
    "QueueTimeout",
    "RefreshReport",
    "Refresher",
    "RouteNotFound",
    "TooManyConnections",
    "Unauthorized",
    "UpstreamError",
]
