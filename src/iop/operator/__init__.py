"""The kopf operator for the EdgeConfig custom resource (`iop operator ...`, docs/operator.md).

- `running`: `iop operator run`; `workers`: a task per EdgeConfig; `leading`: the Lease; `metrics`;
  `hubcertificates`: the Node link's TLS Secret, made at start;
- a pass: `reconciling` (observe, act, report) and `deciding` (pure, on the `values` a pass
  observes), with `restarting` (stamp the workloads, apply live), `restoring` (back to the stable
  revision), `recording` (the applied record), `announcing` (Events and status), `pinning`,
  `repairing` (drift repair), `gating` (the restart gates and the stable revision, pure),
  `revisions` (the cluster revisions and their outcomes, pure), `keeping` (their configs, for a
  pin), `tokensecrets`, `watching`, `documents`, `rolling`, `liveapplying` and `discovering`;
- `webhook/`: the validating webhook, its plan, its HTTPS server and certificate;
- `status/`: the status model, a pass's findings as status, what is written, Events;
- `adminapi`, `kubeapi`: the clients of the Edge's admin API and of Kubernetes; `errors`;
  `crds`: the CRD from the model; `conventions`: the names the chart shares.
It talks to the Edge only over that admin API and imports nothing of `iop.edge`; the config model
(`iop.edgeconfig`) is all they share. docs/architecture.md, "Layers", says why it is `iop.operator`.
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
