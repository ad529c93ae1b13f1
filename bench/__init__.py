"""The benchmarks: each module prints figures and ratios against a peer or the direct path, in one
run (docs/benchmarks.md records them with the date and the command). Run one from the checkout's
root as `uv run --frozen python -m bench.NAME --help`; `benchkit` holds what they share, and
`studies/` the finished one-off comparisons (YAML parsers, HTTP clients, HTTP servers) whose
choice is made and recorded. `tests/bench/` runs each one briefly so that none rots.
"""
