"""Finished one-off comparisons, kept so their figures in docs/benchmarks.md can be reproduced:
`yaml_parsers` (the config's YAML loader), `http_clients` (the Node's `openai` adapter's client).
(`http_servers`, uvicorn against granian for the Edge's OpenAI app, left when that app stopped
being ASGI; it is in the history at 6d80a62.) Each installs its candidates, pinned, into a virtual
environment of its own (`benchkit.ensure_venv`), never into the project's.
"""
