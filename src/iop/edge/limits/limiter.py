"""Enforcing `openai.limits[]` at admission: before a request takes a slot or a queue place,
may it start?

`Limiter.admit()` picks the limits that hold a request (`limits/rules.py`), asks the store (this
process's counters, or the shared Redis of `openai.limit_store`: `limits/rediscounters.py`) and
either refuses (`RateLimited`: 429 `rate_limit_exceeded`) or returns a `Grant`: the answer's
`x-ratelimit-*` headers, and `finish()`, which corrects the estimate to the reported usage and
gives the place back. The rules come from the dispatcher's snapshot, so a refresh changes them at
once; a request no limit holds costs one dict lookup. When the shared store fails, admissions
count in this process for a second before it is tried again. docs/edge.md, "Limits per
principal", has the answers, the headers and the fallback.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from iop.aiokits import LogThrottle
from iop.edgeconfig import EdgeConfig

from ..authenticating import Principal
from ..bodies import ParsedRequest, estimate_tokens
from ..errors import RateLimited
from ..pool import Dispatcher
from .rediscounters import LimitStoreError, RedisCounters
from .rules import (
    Check,
    LocalCounters,
    Quota,
    Refusal,
    RuleSet,
    ScopeUse,
    Verdict,
    budget_period,
    judge,
)

logger = logging.getLogger(__name__)

#: After a failure of the shared store, admissions count in process for this long.
STORE_BACKOFF_S: Final = 1.0

Clock = Callable[[], float]


class Grant:
    """A request's admission: the headers of its answer and what it took, given back at the end."""

    __slots__ = ("_checks", "_done", "_lease", "_limiter", "_started", "_taken", "headers")

    def __init__(
        self,
        limiter: Limiter | None,
        checks: tuple[Check, ...],
        taken: int,
        started: float,
        lease: str | None,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        self._limiter = limiter
        self._checks = checks
        self._taken = taken
        self._started = started
        self._lease = lease  # the shared store's, when it admitted the request
        self._done = False
        self.headers = headers

    def finish(self, spent: int | None, answered: bool) -> None:
        """The answer ended: `spent` tokens as the upstream reported them (None: no usage came,
        so the estimate stands for an answered request and is given back for one that was not)."""
        if self._done or self._limiter is None:
            return
        self._done = True
        if spent is None:
            spent = self._taken if answered else 0
        self._limiter._settle(self._checks, self._taken, spent, self._started, self._lease)


#: The grant of a request that no limit holds.
NO_GRANT: Final = Grant(None, (), 0, 0.0, None, [])


class Limiter:
    """The limits of the current config, their counters, and their metrics."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        config: EdgeConfig,
        *,
        registry: CollectorRegistry | None = None,
        clock: Clock = time.time,
    ) -> None:
        self._dispatcher = dispatcher
        self._clock = clock
        self._local = LocalCounters()
        self._config: EdgeConfig | None = None
        self._rules = RuleSet(config.openai)
        section = config.openai.limit_store
        self.store: RedisCounters | None = None
        if section.url:
            replica = f"{config.edge.id}-{os.getpid()}-{os.urandom(4).hex()}"
            self.store = RedisCounters(section, replica, clock)
        self._store_down_until = 0.0
        self._store_errors = LogThrottle(logger)
        self._seen: dict[str, tuple[str, str, int, int, int]] = {}  # budgets, as last seen
        self._limited = Counter(
            "iop_edge_limited_requests",
            "Requests refused by a limit of openai.limits, by principal, the limit "
            "(requests_per_minute, tokens_per_minute, max_concurrent, budget) and the entry "
            "that refused (its selector: principal|token_ref|model).",
            ["principal_ref", "limit", "selector"],
            registry=registry,
        )
        self._fallbacks = Counter(
            "iop_edge_limit_store_fallbacks",
            "Admissions counted in this Edge's process because the shared limit store failed "
            "or was backing off after a failure.",
            registry=registry,
        )
        if registry is not None:
            registry.register(_BudgetCollector(self))

    async def start(self) -> None:
        if self.store is not None:
            await self.store.start()

    # -- where stored responses live, for every replica (the Responses API) -------------------

    def share_home(self, response_id: str, provider_id: str, model_id: str) -> None:
        """Tell the other replicas (through the shared store, when there is one) which
        provider holds a stored response."""
        if self.store is not None:
            self.store.keep_home(response_id, f"{provider_id}\t{model_id}")

    def unshare_home(self, response_id: str) -> None:
        if self.store is not None:
            self.store.forget_home(response_id)

    async def shared_home(self, response_id: str) -> tuple[str, str] | None:
        """(provider id, model id) of a stored response another replica recorded; None when
        none did, there is no shared store, or it cannot be asked now."""
        if self.store is None:
            return None
        try:
            found = await self.store.find_home(response_id)
        except LimitStoreError as exc:
            self._store_errors.warning(
                "the limit store could not say where response %r lives: %s", response_id, exc
            )
            return None
        if found is None or "\t" not in found:
            return None
        provider_id, model_id = found.split("\t", 1)
        return provider_id, model_id

    async def stop(self) -> None:
        if self.store is not None:
            await self.store.stop()

    def rules(self) -> RuleSet:
        """The rules of the config dispatch runs on now (rebuilt after a refresh)."""
        config = self._dispatcher.snapshot.config
        if config is not self._config:
            if self._config is not None:
                self._rules = RuleSet(config.openai)
                self._local.forget({rule.key for rule in self._rules.rules})
            self._config = config
        return self._rules

    async def admit(self, principal: Principal, model: str, request: ParsedRequest) -> Grant:
        """Admit the request or raise `RateLimited`; `model`: the catalog id asked for."""
        rules = self.rules()
        if not rules:
            return NO_GRANT
        checks = rules.select(principal.principal_ref, principal.token_ref, model)
        if not checks:
            return NO_GRANT
        estimate = (
            estimate_tokens(request) if any(check.rule.counts_tokens for check in checks) else 0
        )
        now = self._clock()
        verdict: Verdict | None = None
        lease: str | None = None
        store = self.store
        if store is not None:
            if time.monotonic() >= self._store_down_until:
                # What this process admitted on its own while the store failed, and still runs,
                # holds places too (the store never counted it).
                unshared = [self._local.unshared(check) for check in checks]
                try:
                    admitted, seen, taken = await store.admit(
                        checks, estimate, now, unshared=unshared
                    )
                except LimitStoreError as exc:
                    self._store_failed(exc)
                else:
                    verdict = judge(checks, seen, estimate, now, admitted)
                    if admitted:
                        lease = taken
                        self._local.hold(checks)  # for a fallback: this process runs it
                    self._remember_budgets(checks, [state.budget_spent for state in seen], now)
            if verdict is None:
                self._fallbacks.inc()
        if verdict is None:
            verdict = self._local.admit(checks, estimate, now)
        refusal = verdict.refusal
        if refusal is not None:
            self._limited.labels(
                principal.principal_ref, refusal.limit, refusal.check.rule.key
            ).inc()
            raise rate_limited(refusal, principal.principal_ref, now)
        return Grant(self, checks, estimate, now, lease, quota_headers(verdict.quota))

    def _settle(
        self, checks: tuple[Check, ...], taken: int, spent: int, started: float, lease: str | None
    ) -> None:
        now = self._clock()
        if lease is not None and self.store is not None:
            self._local.release(checks)
            self.store.settle(lease, checks, taken, spent, started, now)
        else:
            self._local.settle(checks, taken, spent, started, now)
        if spent != taken and any(check.rule.budget is not None for check in checks):
            for check in checks:
                seen = self._seen.get(check.scope)
                if seen is not None:
                    principal, key, tokens, used, ends = seen
                    self._seen[check.scope] = (principal, key, tokens, used + spent - taken, ends)

    def _store_failed(self, exc: LimitStoreError) -> None:
        self._store_down_until = time.monotonic() + STORE_BACKOFF_S
        store = self.store
        if store is not None:  # until a call to it succeeds again (its heartbeat, an admission)
            store.connected = False
        self._store_errors.warning(
            "the limit store %s failed (%s): limits count in this Edge's process until it "
            "answers again",
            store.url if store is not None else "",
            exc,
        )

    def _remember_budgets(self, checks: tuple[Check, ...], spent: list[int], now: float) -> None:
        """What the shared store said of each budget (the in-process ones are read at once)."""
        for index, check in enumerate(checks):
            budget = check.rule.budget
            if budget is None:
                continue
            used = spent[index]
            _, ends = budget_period(budget, now)
            self._seen[check.scope] = (
                check.principal_ref,
                check.rule.key,
                budget.tokens,
                used,
                ends,
            )

    def budgets_seen(self) -> Iterator[tuple[str, str, int]]:
        """(principal, selector, tokens left) of every budget that counted a request, as this
        Edge last saw it: from the shared store's answers, or this process's counters."""
        now = self._clock()
        for check, principal in self.rules().scopes():
            budget = check.rule.budget
            if budget is None or check.scope in self._seen or not self._local.knows(check.scope):
                continue
            yield (
                principal,
                check.rule.key,
                max(0, budget.tokens - self._local.budget_spent(check, now)),
            )
        for principal, key, tokens, used, ends in self._seen.values():
            yield principal, key, max(0, tokens - used) if now < ends else tokens

    async def status(self) -> dict[str, Any]:
        """Each limit's current use per principal (`GET /status` of the admin API)."""
        rules = self.rules()
        scopes = rules.scopes()
        now = self._clock()
        checks = tuple(check for check, _ in scopes)
        store = self.store
        source = "local"
        uses: list[ScopeUse]
        if store is not None and checks:
            try:
                uses = await store.use(checks, now)
                source = "shared"
            except LimitStoreError as exc:
                self._store_failed(exc)
                uses = [self._local.use(check, now) for check in checks]
        else:
            uses = [self._local.use(check, now) for check in checks]
        entries = []
        for (check, principal), use in zip(scopes, uses, strict=True):
            rule = check.rule
            limits: dict[str, Any] = {
                name: getattr(rule, name)
                for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent")
                if getattr(rule, name) is not None
            }
            current: dict[str, Any] = {}
            if use.requests_available is not None:
                current["requests_available"] = math.floor(use.requests_available)
            if use.tokens_available is not None:
                current["tokens_available"] = math.floor(use.tokens_available)
            if rule.max_concurrent is not None:
                current["in_progress"] = use.in_progress
            if rule.budget is not None:
                limits["budget"] = rule.budget.model_dump()
                current["budget_used"] = use.budget_used
                current["budget_resets_at"] = _iso(use.budget_resets_at)
            entries.append(
                {
                    "selector": rule.key,
                    "principal_ref": principal,
                    "token_ref": rule.token_ref,
                    "model": rule.model,
                    "limits": limits,
                    "use": current,
                }
            )
        return {
            "store": store.url if store is not None else "local",
            "counted": source,
            "store_connected": store.connected if store is not None else None,
            "entries": entries,
        }


class _BudgetCollector(Collector):
    def __init__(self, limiter: Limiter) -> None:
        self._limiter = limiter

    def collect(self) -> Iterator[Metric]:
        remaining = GaugeMetricFamily(
            "iop_edge_limit_budget_remaining_tokens",
            "Tokens left in a principal's budget period (openai.limits[].budget), as this Edge "
            "last saw it, by principal and the entry's selector.",
            labels=["principal_ref", "selector"],
        )
        for principal, key, left in sorted(self._limiter.budgets_seen()):
            remaining.add_metric([principal, key], left)
        yield remaining


# -- how a verdict is said in HTTP -------------------------------------------------------------

_WHAT: Final = {
    "requests_per_minute": "requests per minute",
    "tokens_per_minute": "tokens per minute",
    "max_concurrent": "requests at once",
    "budget": "token budget",
}


def rate_limited(refusal: Refusal, principal: str, now: float) -> RateLimited:
    """The 429 for `refusal`: its message names the limit, its headers say when to retry."""
    rule = refusal.check.rule
    path = f"{rule.path()}.{refusal.limit}"
    what = _WHAT[refusal.limit]
    if refusal.limit == "budget" and rule.budget is not None:
        what = f"{'daily' if rule.budget.period == 'day' else 'monthly'} token budget"
    headers: list[tuple[bytes, bytes]] = []
    wait = refusal.retry_after_s
    if wait is None:
        message = (
            f"Request too large for principal {principal} on {what} ({path}): Limit "
            f"{refusal.value}, Requested {refusal.requested}. It can never pass: the input "
            "or output tokens must be reduced in order to run successfully."
        )
        headers.append((b"x-should-retry", b"false"))
    else:
        if refusal.limit == "max_concurrent":
            message = (
                f"Too many requests at once for principal {principal} ({path}): Limit "
                f"{refusal.value}, In progress {refusal.used}. Please try again when one of "
                "them ends."
            )
        elif refusal.limit == "budget":
            message = (
                f"Token budget used up for principal {principal} ({path}, {what}): Limit "
                f"{refusal.value}, Used {refusal.used}, Requested {refusal.requested}. It resets "
                f"at {_iso(refusal.resets_at)}."
            )
        else:
            message = (
                f"Rate limit reached for principal {principal} on {what} ({path}): Limit "
                f"{refusal.value}, Used {refusal.used}, Requested {refusal.requested}. Please "
                f"try again in {duration(wait)}."
            )
        headers += [
            (b"retry-after", str(max(1, math.ceil(wait))).encode()),
            (b"retry-after-ms", str(max(1, math.ceil(wait * 1000))).encode()),
        ]
    if refusal.limit in ("requests_per_minute", "tokens_per_minute"):
        kind = "requests" if refusal.limit == "requests_per_minute" else "tokens"
        used = min(refusal.used, refusal.value)
        headers += _headers(kind, refusal.value, refusal.value - used, used * 60 / refusal.value)
    kind = "requests" if refusal.limit in ("requests_per_minute", "max_concurrent") else "tokens"
    return RateLimited(message, kind, headers)


def quota_headers(quota: Quota) -> list[tuple[bytes, bytes]]:
    """OpenAI's `x-ratelimit-*` headers for what is left after a request."""
    headers: list[tuple[bytes, bytes]] = []
    if quota.requests is not None:
        headers += _headers("requests", *quota.requests)
    if quota.tokens is not None:
        headers += _headers("tokens", *quota.tokens)
    return headers


def _headers(kind: str, limit: int, remaining: int, reset_s: float) -> list[tuple[bytes, bytes]]:
    suffix = kind.encode()
    return [
        (b"x-ratelimit-limit-" + suffix, str(limit).encode()),
        (b"x-ratelimit-remaining-" + suffix, str(remaining).encode()),
        (b"x-ratelimit-reset-" + suffix, duration(reset_s).encode()),
    ]


def duration(seconds: float) -> str:
    """A duration as OpenAI's headers write it (Go's): `20ms`, `1s`, `1.5s`, `6m0s`, `1h2m3s`."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms" if seconds > 0 else "0s"
    millis = math.ceil(seconds * 1000)
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def _iso(moment: float | None) -> str | None:
    if moment is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(moment))
