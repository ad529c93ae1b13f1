"""The EdgeConfig: its model, loading with complete validation, hashing and change classification.

This package is pure: it imports nothing from the servers. The Edge, the Node and the operator
all build on it.
"""

from .classifying import classify
from .configs import (
    ANONYMOUS_PRINCIPAL,
    EVERY_PRINCIPAL,
    A2ASection,
    AdminSection,
    BootstrapSection,
    ControlPlaneSection,
    EdgeConfig,
    EdgeSection,
    FakeAdapterSettings,
    GenerationPolicy,
    HealthPolicy,
    LimitStoreSection,
    MetricsSection,
    ModelSpec,
    NodeLinkSection,
    NodeRuntime,
    NodeSpec,
    OpenAIAdapterSettings,
    OpenAISection,
    PrincipalLimit,
    PrincipalToken,
    ProviderSpec,
    RetrySection,
    SecretKeyRef,
    TlsSection,
    TokenBudget,
    camel_path,
    is_loopback_listener,
    split_listener,
)
from .errors import ConfigError, Problem
from .loading import load_data, load_file, load_text, parse_yaml
from .payloads import NodePayload, ProviderPayload, node_payload, node_payloads
from .reports import ChangeReport, RestartPath
from .secrets import is_secret_field
from .tokens import TokenRef, require_token_hashes, token_refs, with_token_hashes
from .trees import config_hash

__all__ = [
    "ANONYMOUS_PRINCIPAL",
    "EVERY_PRINCIPAL",
    "A2ASection",
    "AdminSection",
    "BootstrapSection",
    "ChangeReport",
    "ConfigError",
    "ControlPlaneSection",
    "EdgeConfig",
    "EdgeSection",
    "FakeAdapterSettings",
    "GenerationPolicy",
    "HealthPolicy",
    "LimitStoreSection",
    "MetricsSection",
    "ModelSpec",
    "NodeLinkSection",
    "NodePayload",
    "NodeRuntime",
    "NodeSpec",
    "OpenAIAdapterSettings",
    "OpenAISection",
    "PrincipalLimit",
    "PrincipalToken",
    "Problem",
    "ProviderPayload",
    "ProviderSpec",
    "RestartPath",
    "RetrySection",
    "SecretKeyRef",
    "TlsSection",
    "TokenBudget",
    "TokenRef",
    "camel_path",
    "classify",
    "config_hash",
    "is_loopback_listener",
    "is_secret_field",
    "load_data",
    "load_file",
    "load_text",
    "node_payload",
    "node_payloads",
    "parse_yaml",
    "require_token_hashes",
    "split_listener",
    "token_refs",
    "with_token_hashes",
]
