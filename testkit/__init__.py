"""What the tests, the benchmarks and the end-to-end tests share, as one package they import.

- `documents`: Edge config documents (`edge_document`, `provider`), the clients and node tokens
  they know (`CLIENTS`, `CLIENT_TOKEN`, `node_token_of`), and `find_provider`;
- `otlp`: a real OTLP/gRPC trace receiver the processes under test export their spans to.

It sits at the checkout's root, beside `tests/`, `bench/` and `e2e/`, so that none of them
imports another's code: a benchmark never loads a test module, nor a test a benchmark. It is no
part of the product (`iop` under src/ never imports it) and imports `iop` only where it must.
"""

from .documents import (
    CLIENT_TOKEN,
    CLIENTS,
    Client,
    Document,
    Placement,
    edge_document,
    find_provider,
    node_token_of,
    provider,
)

__all__ = [
    "CLIENTS",
    "CLIENT_TOKEN",
    "Client",
    "Document",
    "Placement",
    "edge_document",
    "find_provider",
    "node_token_of",
    "provider",
]
