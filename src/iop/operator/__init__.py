"""The kopf operator for the EdgeConfig custom resource (`iop operator ...`, docs/operator.md).

It lives at `src/iop/operator/`, so it is only ever imported as `iop.operator`: nothing puts
`src/iop/` on `sys.path`, and the standard library's `operator` stays the one `import operator`
finds (tests/test_layout.py pins this).

The operator talks to the Edge only over its admin HTTP API and imports nothing of `iop.edge`
(import-linter holds it to that); the config model (`iop.edgeconfig`) is the one thing they share.
"""

from .crds import crd_yaml, edgeconfig_crd
from .errors import OperatorError
from .reconciling import PassTimings
from .running import OperatorOptions, default_namespace, run_operator

__all__ = [
    "OperatorError",
    "OperatorOptions",
    "PassTimings",
    "crd_yaml",
    "default_namespace",
    "edgeconfig_crd",
    "run_operator",
]
