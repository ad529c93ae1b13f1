"""The EdgeConfig: its model, loading with complete validation, hashing and change classification.

- `configs`: the pydantic model's root (edge.yaml, the CRD spec, `kubectl explain`), its
  sections in `edgesections`, `openaisections`, `limitsections`, `prioritysections`,
  `modelspecs`, `nodespecs` and `rolloutsections`, and what they are made of (apply markers,
  value types, the base) in `fields`; `loading`: text, a file or a document to an
  `EdgeConfig`, or a `ConfigError` (`errors`) with every problem;
- `validating`: the checks between values; `secrets`: what counts as a secret; `tokens`: tokens
  named by a Kubernetes Secret; `payloads`: what one Node receives;
- `trees`: the id-keyed tree and its hash; `classifying`: every change live or restart-required,
  as a report (`reports`); `trials`: how a live change goes on trial (a canary or all at once);
  `documenting`: the field reference of docs/config.md; `upstreampolicy`: what providers may
  reach and where each API key may go, given by whoever runs a process, never by the config.

This package is pure: it imports nothing from the servers. The Edge, the Node and the operator
all build on it.
"""

from .classifying import classify
from .configs import EdgeConfig
from .edgesections import AdminSection, NodeLinkSection
from .errors import ConfigError, Problem
from .fields import SecretKeyRef, camel_path, is_loopback_listener
from .limitsections import EVERY_PRINCIPAL, LimitStoreSection, PrincipalLimit, TokenBudget
from .loading import load_data, load_file, load_text, parse_yaml
from .modelspecs import DispatchSettings, GenerationPolicy, ModelSpec
from .nodespecs import AdapterSettings, FakeAdapterSettings, HealthPolicy, OpenAIAdapterSettings
from .openaisections import ANONYMOUS_PRINCIPAL, OpenAISection, RetrySection
from .payloads import NodePayload, ProviderPayload, edge_share, node_payload, node_payloads
from .prioritysections import DEFAULT_PRIORITY_CLASS
from .reports import ChangeReport, RestartPath
from .rolloutsections import RolloutSection
from .secrets import is_secret_field
from .tokens import TokenRef, require_token_hashes, token_refs, token_sha256, with_token_hashes
from .trees import config_hash
from .trials import Trial, plan_trial
from .upstreampolicy import UpstreamPolicy, parse_policy

__all__ = [
    "ANONYMOUS_PRINCIPAL",
    "DEFAULT_PRIORITY_CLASS",
    "EVERY_PRINCIPAL",
    "AdapterSettings",
    "AdminSection",
    "ChangeReport",
    "ConfigError",
    "DispatchSettings",
    "EdgeConfig",
    "FakeAdapterSettings",
    "GenerationPolicy",
    "HealthPolicy",
    "LimitStoreSection",
    "ModelSpec",
    "NodeLinkSection",
    "NodePayload",
    "OpenAIAdapterSettings",
    "OpenAISection",
    "PrincipalLimit",
    "Problem",
    "ProviderPayload",
    "RestartPath",
    "RetrySection",
    "RolloutSection",
    "SecretKeyRef",
    "TokenBudget",
    "TokenRef",
    "Trial",
    "UpstreamPolicy",
    "camel_path",
    "classify",
    "config_hash",
    "edge_share",
    "is_loopback_listener",
    "is_secret_field",
    "load_data",
    "load_file",
    "load_text",
    "node_payload",
    "node_payloads",
    "parse_policy",
    "parse_yaml",
    "plan_trial",
    "require_token_hashes",
    "token_refs",
    "token_sha256",
    "with_token_hashes",
]
