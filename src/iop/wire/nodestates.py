"""What a Node says besides runs: why a provider is unhealthy, how far a drain is, how loaded a
provider's model server says it is (`ServerLoad`), and its answer to a config push (`ConfigAck`).

Reasons are codes, so the Edge can put them in a metric label and a status page can group by
them; the sentence for people travels beside them (`ProviderHealth.detail`). A code that an
older or newer peer does not know is shown as it came.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

#: Most adapter names a server's load carries in each list (a server holds a few at once).
MAX_ADAPTERS: Final = 64

# -- why a provider is unhealthy (ProviderHealth.reason) ----------------------------------------

#: The Node's probes of the upstream failed `failure_threshold` times in a row.
PROBE_FAILED: Final = "probe_failed"
#: `request_failure_threshold` real requests in a row failed on the upstream (outlier detection).
REQUEST_FAILURES: Final = "request_failures"
#: The Node is draining before it exits (SIGTERM).
DRAINING: Final = "draining"
#: The provider's adapter could not start (invalid settings, its API key variable unset).
ADAPTER_ERROR: Final = "adapter_error"
#: The Node has not probed the upstream yet (it just started, or the provider is new).
NOT_PROBED: Final = "not_probed"
#: Edge side: the provider's Node is not connected.
NODE_DISCONNECTED: Final = "node_disconnected"
#: Edge side: the Node is connected but said nothing about this provider yet.
NOT_REPORTED: Final = "not_reported"
#: Edge side: the Node said unhealthy without a reason (a Node that predates the codes).
UNSPECIFIED: Final = "unspecified"

#: Every reason this release knows, in the order status pages list them.
HEALTH_REASONS: Final = (
    PROBE_FAILED,
    REQUEST_FAILURES,
    DRAINING,
    ADAPTER_ERROR,
    NOT_PROBED,
    NODE_DISCONNECTED,
    NOT_REPORTED,
    UNSPECIFIED,
)


@dataclass(frozen=True, slots=True)
class ConfigAck:
    """A Node's answer to a config payload of generation `generation` (welcome or push).

    `ok`: the Node built it (else `error` says why). `pending`: built but not in use yet, since
    a Node connected to several Edge replicas switches only once every one sends it;
    `in_use_hash` is the payload it runs meanwhile. Texts are cut to their bounds already.
    """

    generation: int
    config_hash: str
    ok: bool
    error: str = ""
    pending: bool = False
    in_use_hash: str = ""


@dataclass(frozen=True, slots=True)
class DrainProgress:
    """The runs a Node still waits for before a drain is done, per provider.

    A registry swap drains the adapters it replaced; SIGTERM (`shutting_down`) drains the whole
    Node, and then every run in flight counts. Nothing left and not shutting down: no drain.
    """

    shutting_down: bool = False
    runs_left: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def draining(self) -> bool:
        return self.shutting_down or bool(self.runs_left)

    @property
    def total(self) -> int:
        return sum(self.runs_left.values())


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """What a model server's own `/metrics` said of its load when the Node's probe last read
    them (vLLM's names: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
    `vllm:kv_cache_usage_perc`). `age_s`: how old the reading was when the Node reported it;
    `not_ours`: of running + waiting, the requests that were not the Node's runs then (other
    clients of the server)."""

    running: int = 0
    waiting: int = 0
    #: KV-cache use, 0..1.
    kv_cache_usage: float = 0.0
    age_s: float = 0.0
    not_ours: int = 0
    #: vLLM's `vllm:lora_requests_info` (its latest sample): the LoRA adapters of the server's
    #: running requests and of its waiting ones, and the most adapters one batch may hold
    #: (`--max-loras`); 0 when the server says nothing of adapters.
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    max_loras: int = 0

    @property
    def active_adapters(self) -> frozenset[str]:
        """The adapters the server's requests hold or wait for: loaded, or about to be."""
        return frozenset(self.running_adapters) | frozenset(self.waiting_adapters)
