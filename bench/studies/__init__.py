"""Finished one-off comparisons, kept so their figures in docs/benchmarks.md can be reproduced:
`yaml_parsers` (the config's YAML loader), `http_clients` (the Node's `openai` adapter's client),
`http_servers` (the Edge's HTTP server). Each installs its candidates, pinned, into a virtual
environment of its own (`benchkit.ensure_venv`), never into the project's.
"""
