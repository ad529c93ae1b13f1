"""The validating webhook: the plan a change gets, the handler, and its HTTPS server.

- `validating`: the kopf handler: validate a spec, classify it against what was applied;
- `plans`: the plan in words (the warnings `kubectl apply` prints) and the refusal message;
- `admission`: the HTTPS server the API server calls; `certificates`: its self-signed
  certificate, shared by the replicas through a Secret, and the CA bundle it patches.
"""

from .admission import AdmissionServer
from .certificates import (
    SelfSignedCertificate,
    ca_bundle_current,
    owner_reference,
    patch_ca_bundle,
    shared_certificate,
)
from .validating import WEBHOOK_ID, register_webhook

__all__ = [
    "WEBHOOK_ID",
    "AdmissionServer",
    "SelfSignedCertificate",
    "ca_bundle_current",
    "owner_reference",
    "patch_ca_bundle",
    "register_webhook",
    "shared_certificate",
]
