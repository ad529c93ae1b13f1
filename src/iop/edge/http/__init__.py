"""Requests in and out: the Edge's three HTTP apps, the server they run on and its caps.

- `openaiapp`: the OpenAI API (`OpenAIApp`), with `storedresponses`: where each stored response
  of the Responses API lives, its retrieve, delete and cancel routes, and the errors that name
  one; `adminapp`: the admin API (refresh, config, status), with `adminauth` (who may use it)
  and `statusdocument` (what `/status` and `/config` answer); `metricsapp`: `GET /metrics` on
  a listener of its own;
- `responses`: the one place an error becomes a status and a body, for all three;
- `server`: the HTTP server, `connections`: one client connection (httptools' parser, the caps
  enforced), `exchanges`: one request and its answer as the apps see them; `caps`: what the
  server refuses before an app sees a request; `clientguard`: what one client may do (requests
  at once, failed keys).
"""

from .adminapp import AdminApp
from .adminauth import AdminAuth, AdminAuthError
from .caps import HttpCaps
from .clientguard import ClientGuard
from .metricsapp import MetricsApp
from .openaiapp import OpenAIApp
from .server import HttpServer

__all__ = [
    "AdminApp",
    "AdminAuth",
    "AdminAuthError",
    "ClientGuard",
    "HttpCaps",
    "HttpServer",
    "MetricsApp",
    "OpenAIApp",
]
