"""The end-to-end tests and what they run on: a real, local Kubernetes cluster (`e2e.cluster`),
the checking tools built from pinned Go modules (`e2e.tools`), the operator's tests against that
cluster (`e2e.operator`) and the chart's install test.

Imported from the checkout's root (pytest's `pythonpath`, or `python3 -m e2e.cluster.localcluster`
run there), never through `sys.path`; e2e/cluster/README.md has the command lines.
"""
