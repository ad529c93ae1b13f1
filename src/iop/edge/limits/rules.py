"""The rules of `openai.limits[]`: which limits hold a request, and whether it may start now.

Pure: no I/O and no clock of its own (every call takes `now`, Unix seconds), so the same rules run
in one process (`LocalCounters`) and, as a Lua script, in a Redis the replicas share
(`limits/rediscounters.py`), and a test can move time at will. Every entry that selects a
request holds it, on counters of its own: `requests_per_minute` and `tokens_per_minute` as token
buckets (the tokens taken at the estimate, corrected to the usage), `max_concurrent` requests in
progress, a `budget` of tokens per period; a request takes from all of them or from none.
docs/edge.md, "Limits per principal", explains them for operators.
"""

from __future__ import annotations

import calendar
import math
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Final, Literal

from iop.edgeconfig import EVERY_PRINCIPAL, OpenAISection, PrincipalLimit, TokenBudget

LimitName = Literal["requests_per_minute", "tokens_per_minute", "max_concurrent", "budget"]
#: Every limit an entry may set, in the order a refusal is looked for.
LIMIT_NAMES: Final[tuple[LimitName, ...]] = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent",
    "budget",
)

_MINUTE: Final = 60.0
_DAY: Final = 86_400


@dataclass(frozen=True, slots=True)
class Rule:
    """One entry of `openai.limits[]`."""

    key: str  # principal|token_ref|model, as in the config's paths
    principal_ref: str
    token_ref: str | None
    model: str | None
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent: int | None
    budget: TokenBudget | None

    @classmethod
    def of(cls, spec: PrincipalLimit) -> Rule:
        return cls(
            key=spec.list_key,
            principal_ref=spec.principal_ref,
            token_ref=spec.token_ref,
            model=spec.model,
            requests_per_minute=spec.requests_per_minute,
            tokens_per_minute=spec.tokens_per_minute,
            max_concurrent=spec.max_concurrent,
            budget=spec.budget,
        )

    @property
    def counts_tokens(self) -> bool:
        return self.tokens_per_minute is not None or self.budget is not None

    def path(self) -> str:
        return f"openai.limits[{self.key}]"


@dataclass(frozen=True, slots=True)
class Check:
    """One rule as it holds one request: the rule and the counters it counts on (`scope`)."""

    rule: Rule
    #: The counters' key: the rule's key, and the principal for a rule of every principal.
    scope: str
    #: The principal whose requests these counters hold.
    principal_ref: str


class RuleSet:
    """The rules of one config, and which of them hold a request (cached per selection)."""

    __slots__ = ("_by_principal", "_cache", "_every", "principals", "rules")

    def __init__(self, section: OpenAISection) -> None:
        self.rules: tuple[Rule, ...] = tuple(Rule.of(spec) for spec in section.limits)
        self._every = tuple(rule for rule in self.rules if rule.principal_ref == EVERY_PRINCIPAL)
        by_principal: dict[str, list[Rule]] = {}
        for rule in self.rules:
            if rule.principal_ref != EVERY_PRINCIPAL:
                by_principal.setdefault(rule.principal_ref, []).append(rule)
        self._by_principal = {key: tuple(value) for key, value in by_principal.items()}
        #: Every principal a request can have under this config (for `*` rules' scopes).
        self.principals: tuple[str, ...] = tuple(
            sorted(
                {token.principal_ref for token in section.principal_tokens}
                | {"anonymous"}
                | self._by_principal.keys()
            )
        )
        self._cache: dict[tuple[str, str, str], tuple[Check, ...]] = {}

    def __bool__(self) -> bool:
        return bool(self.rules)

    def select(self, principal_ref: str, token_ref: str, model: str) -> tuple[Check, ...]:
        """The checks that hold a request of this principal, token and (asked) model."""
        key = (principal_ref, token_ref, model)
        found = self._cache.get(key)
        if found is None:
            found = tuple(
                Check(rule, _scope(rule, principal_ref), principal_ref)
                for rule in (*self._by_principal.get(principal_ref, ()), *self._every)
                if (rule.token_ref is None or rule.token_ref == token_ref)
                and (rule.model is None or rule.model == model)
            )
            if len(self._cache) < 4096:  # bounded: principals x tokens x models of one config
                self._cache[key] = found
        return found

    def scopes(self) -> list[tuple[Check, str]]:
        """Every (check, principal) whose counters exist under this config, for status pages."""
        result: list[tuple[Check, str]] = []
        for rule in self.rules:
            if rule.principal_ref == EVERY_PRINCIPAL:
                result += [(Check(rule, _scope(rule, p), p), p) for p in self.principals]
            else:
                result.append((Check(rule, rule.key, rule.principal_ref), rule.principal_ref))
        return result


def _scope(rule: Rule, principal_ref: str) -> str:
    return f"{rule.key}#{principal_ref}" if rule.principal_ref == EVERY_PRINCIPAL else rule.key


def _rule_key(scope: str) -> str:
    """The rule of a scope: a `*` rule's key (`*|*|model`, no '#' in it) before the '#'."""
    return scope.split("#", 1)[0] if scope.startswith(EVERY_PRINCIPAL + "|") else scope


#: The last period computed per (period, reset_at): most admissions fall in it.
_PERIODS: dict[tuple[str, str], tuple[int, int]] = {}


def budget_period(budget: TokenBudget, now: float) -> tuple[int, int]:
    """The period of `budget` that holds `now`: (start, end) in Unix seconds."""
    key = (budget.period, budget.reset_at)
    found = _PERIODS.get(key)
    if found is not None and found[0] <= now < found[1]:
        return found
    found = _PERIODS[key] = _period(budget, now)
    return found


def _period(budget: TokenBudget, now: float) -> tuple[int, int]:
    hours, minutes = (int(part) for part in budget.reset_at.split(":"))
    offset = hours * 3600 + minutes * 60
    if budget.period == "day":
        start = math.floor((now - offset) / _DAY) * _DAY + offset
        return start, start + _DAY
    moment = _utc(now)
    year, month = moment[0], moment[1]
    start = calendar.timegm((year, month, 1, 0, 0, 0)) + offset
    if start > now:
        year, month = (year, month - 1) if month > 1 else (year - 1, 12)
        start = calendar.timegm((year, month, 1, 0, 0, 0)) + offset
    next_year, next_month = (year, month + 1) if month < 12 else (year + 1, 1)
    return start, calendar.timegm((next_year, next_month, 1, 0, 0, 0)) + offset


def _utc(now: float) -> tuple[int, ...]:
    return tuple(time.gmtime(now))


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request may not start now."""

    check: Check
    limit: LimitName
    value: int  # the limit's value
    used: int  # what is in use or spent now, in the limit's unit
    requested: int  # what this request needs of it
    #: Seconds until the request could pass; None when it never can (it alone is over the limit).
    retry_after_s: float | None
    #: For a budget: when its period ends (Unix seconds).
    resets_at: float | None = None


@dataclass(frozen=True, slots=True)
class Quota:
    """The tightest requests and tokens per minute that hold a request, after it: OpenAI's
    `x-ratelimit-*` headers. None where no limit of that kind holds it."""

    requests: tuple[int, int, float] | None = None  # limit, remaining, seconds until full
    tokens: tuple[int, int, float] | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    refusal: Refusal | None
    quota: Quota


@dataclass(frozen=True, slots=True)
class ScopeUse:
    """What one scope's counters hold now (`GET /status`, the budget gauge)."""

    requests_available: float | None = None
    tokens_available: float | None = None
    in_progress: int = 0
    budget_used: int | None = None
    budget_resets_at: int | None = None


@dataclass(frozen=True, slots=True)
class Observed:
    """What a store saw of one check's counters at `now` (after the take, when it took)."""

    requests: float | None
    tokens: float | None
    in_progress: int
    budget_spent: int


def judge(
    checks: tuple[Check, ...], seen: list[Observed], estimate: int, now: float, admitted: bool
) -> Verdict:
    """The verdict of a store that decided by these rules elsewhere (the Redis script) and
    returned what it saw: the same refusal, or the same quota, as `LocalCounters` would give."""
    if admitted:
        requests: tuple[int, int, float] | None = None
        tokens: tuple[int, int, float] | None = None
        for check, state in zip(checks, seen, strict=True):
            rule = check.rule
            if rule.requests_per_minute is not None and state.requests is not None:
                requests = _tighter(requests, _quota(rule.requests_per_minute, state.requests))
            if rule.tokens_per_minute is not None and state.tokens is not None:
                tokens = _tighter(tokens, _quota(rule.tokens_per_minute, state.tokens))
        return Verdict(None, Quota(requests, tokens))
    refusals = []
    for check, state in zip(checks, seen, strict=True):
        rule = check.rule
        counters = _Counters(
            requests=math.inf if state.requests is None else state.requests,
            requests_at=now,
            requests_limit=rule.requests_per_minute or 0,
            tokens=math.inf if state.tokens is None else state.tokens,
            tokens_at=now,
            tokens_limit=rule.tokens_per_minute or 0,
            in_progress=state.in_progress,
            budget_start=budget_period(rule.budget, now)[0] if rule.budget is not None else -1,
            budget_used=state.budget_spent,
        )
        refusal = _refusal(check, counters, estimate, now)
        if refusal is not None:
            refusals.append(refusal)
    if not refusals:  # the store's arithmetic and ours disagreed at a boundary: one more second
        return Verdict(Refusal(checks[0], LIMIT_NAMES[0], 0, 0, 1, 1.0), Quota())
    return Verdict(_binding(refusals), Quota())


# -- the counters of one process ---------------------------------------------------------------


def _refill(level: float, stamp: float, was: int, now: float, limit: int) -> float:
    """A bucket's level at `now`: refilled at limit/60 per second since `stamp`, at most full.
    A limit changed since (`was`) keeps what was used: the level moves by the difference."""
    if level == math.inf:
        return float(limit)
    if was != limit:
        level += limit - was
    return min(float(limit), level + max(0.0, now - stamp) * limit / _MINUTE)


@dataclass(slots=True)
class _Counters:
    requests: float = math.inf  # bucket level; inf: never touched (full at any limit)
    requests_at: float = 0.0
    requests_limit: int = 0  # the limit the level was counted against
    tokens: float = math.inf
    tokens_at: float = 0.0
    tokens_limit: int = 0
    in_progress: int = 0  # every request of this process in progress, the shared store's too
    held: int = 0  # of those, the ones the shared store counts
    budget_start: int = -1
    budget_used: int = 0

    def requests_level(self, limit: int, now: float) -> float:
        return _refill(self.requests, self.requests_at, self.requests_limit, now, limit)

    def tokens_level(self, limit: int, now: float) -> float:
        return _refill(self.tokens, self.tokens_at, self.tokens_limit, now, limit)

    def set_requests(self, level: float, limit: int, now: float) -> None:
        self.requests, self.requests_at, self.requests_limit = level, now, limit

    def set_tokens(self, level: float, limit: int, now: float) -> None:
        self.tokens, self.tokens_at, self.tokens_limit = level, now, limit

    def budget_spent(self, start: int) -> int:
        return self.budget_used if self.budget_start == start else 0


@dataclass(slots=True)
class LocalCounters:
    """Every scope's counters in this process: the store of a single Edge, and what an Edge
    falls back to while its shared store is unreachable."""

    _scopes: dict[str, _Counters] = field(default_factory=dict)

    def admit(self, checks: Iterable[Check], estimate: int, now: float) -> Verdict:
        """Take what the request needs from every check's counters, or from none (a refusal)."""
        checks = tuple(checks)
        refusals: list[Refusal] = []
        for check in checks:
            counters = self._scopes.get(check.scope)
            refusal = _refusal(check, counters or _Counters(), estimate, now)
            if refusal is not None:
                refusals.append(refusal)
        if refusals:
            return Verdict(_binding(refusals), Quota())
        requests: tuple[int, int, float] | None = None
        tokens: tuple[int, int, float] | None = None
        for check in checks:
            rule = check.rule
            counters = self._scopes.get(check.scope)
            if counters is None:
                counters = self._scopes[check.scope] = _Counters()
            if rule.requests_per_minute is not None:
                limit = rule.requests_per_minute
                counters.set_requests(counters.requests_level(limit, now) - 1, limit, now)
                requests = _tighter(requests, _quota(limit, counters.requests))
            if rule.tokens_per_minute is not None:
                limit = rule.tokens_per_minute
                counters.set_tokens(counters.tokens_level(limit, now) - estimate, limit, now)
                tokens = _tighter(tokens, _quota(limit, counters.tokens))
            if rule.max_concurrent is not None:
                counters.in_progress += 1
            if rule.budget is not None:
                start, _ = budget_period(rule.budget, now)
                counters.budget_used = counters.budget_spent(start) + estimate
                counters.budget_start = start
        return Verdict(None, Quota(requests, tokens))

    def settle(
        self, checks: Iterable[Check], taken: int, spent: int, started: float, now: float
    ) -> None:
        """A request admitted at `started`, which took `taken` tokens, ended having spent
        `spent`: correct the token counts and give its place back."""
        for check in checks:
            rule = check.rule
            counters = self._scopes.get(check.scope)
            if counters is None:
                continue
            if rule.tokens_per_minute is not None and spent != taken:
                limit = rule.tokens_per_minute
                counters.set_tokens(counters.tokens_level(limit, now) - (spent - taken), limit, now)
            if rule.max_concurrent is not None and counters.in_progress > 0:
                counters.in_progress -= 1
            if rule.budget is not None and spent != taken:
                start, _ = budget_period(rule.budget, started)
                if counters.budget_start == start:  # a new period has nothing to correct
                    counters.budget_used = max(0, counters.budget_used + spent - taken)

    def hold(self, checks: Iterable[Check]) -> None:
        """A request the shared store admitted: its place counts here too, so that a fallback to
        these counters knows what this process already runs."""
        for check in checks:
            if check.rule.max_concurrent is not None:
                counters = self._scopes.get(check.scope)
                if counters is None:
                    counters = self._scopes[check.scope] = _Counters()
                counters.in_progress += 1
                counters.held += 1

    def release(self, checks: Iterable[Check]) -> None:
        """A request the shared store admitted (`hold`) ended."""
        for check in checks:
            counters = self._scopes.get(check.scope)
            if check.rule.max_concurrent is not None and counters is not None:
                counters.in_progress = max(0, counters.in_progress - 1)
                counters.held = max(0, counters.held - 1)

    def unshared(self, check: Check) -> int:
        """Requests in progress that this process admitted on its own (while the shared store
        failed) and the store does not count."""
        counters = self._scopes.get(check.scope)
        return 0 if counters is None else max(0, counters.in_progress - counters.held)

    def knows(self, scope: str) -> bool:
        return scope in self._scopes

    def budget_spent(self, check: Check, now: float) -> int:
        budget = check.rule.budget
        counters = self._scopes.get(check.scope)
        if budget is None or counters is None:
            return 0
        return counters.budget_spent(budget_period(budget, now)[0])

    def use(self, check: Check, now: float) -> ScopeUse:
        counters = self._scopes.get(check.scope) or _Counters()
        rule = check.rule
        budget_used = resets_at = None
        if rule.budget is not None:
            start, resets_at = budget_period(rule.budget, now)
            budget_used = counters.budget_spent(start)
        return ScopeUse(
            requests_available=None
            if rule.requests_per_minute is None
            else counters.requests_level(rule.requests_per_minute, now),
            tokens_available=None
            if rule.tokens_per_minute is None
            else counters.tokens_level(rule.tokens_per_minute, now),
            in_progress=counters.in_progress,
            budget_used=budget_used,
            budget_resets_at=resets_at,
        )

    def forget(self, keys: Collection[str]) -> None:
        """Drop the counters of scopes whose rule is gone (after a refresh); `keys`: the rules'
        keys now."""
        for scope in [scope for scope in self._scopes if _rule_key(scope) not in keys]:
            del self._scopes[scope]


def _refusal(check: Check, counters: _Counters, estimate: int, now: float) -> Refusal | None:
    """The first limit of `check` that has no room for the request, if any."""
    rule = check.rule
    limit = rule.requests_per_minute
    if limit is not None:
        level = counters.requests_level(limit, now)
        if level < 1:
            wait = (1 - level) * _MINUTE / limit
            return Refusal(check, "requests_per_minute", limit, limit - math.floor(level), 1, wait)
    limit = rule.tokens_per_minute
    if limit is not None:
        level = counters.tokens_level(limit, now)
        if estimate > limit:
            return Refusal(check, "tokens_per_minute", limit, _used(limit, level), estimate, None)
        need = max(estimate, 1)  # and never while the bucket is in debt
        if level < need:
            wait = (need - level) * _MINUTE / limit
            return Refusal(check, "tokens_per_minute", limit, _used(limit, level), estimate, wait)
    limit = rule.max_concurrent
    if limit is not None and counters.in_progress >= limit:
        return Refusal(check, "max_concurrent", limit, counters.in_progress, 1, 1.0)
    budget = rule.budget
    if budget is not None:
        start, end = budget_period(budget, now)
        spent = counters.budget_spent(start)
        if estimate > budget.tokens:
            return Refusal(check, "budget", budget.tokens, spent, estimate, None, end)
        if spent + estimate > budget.tokens or spent >= budget.tokens:
            return Refusal(check, "budget", budget.tokens, spent, estimate, end - now, end)
    return None


def _used(limit: int, level: float) -> int:
    return max(0, limit - math.floor(level))


def _binding(refusals: list[Refusal]) -> Refusal:
    """The refusal whose room comes back last (never: first of all)."""
    return max(
        refusals,
        key=lambda r: math.inf if r.retry_after_s is None else r.retry_after_s,
    )


def _quota(limit: int, level: float) -> tuple[int, int, float]:
    return limit, max(0, math.floor(level)), max(0.0, (limit - level) * _MINUTE / limit)


def _tighter(
    current: tuple[int, int, float] | None, other: tuple[int, int, float]
) -> tuple[int, int, float]:
    return other if current is None or other[1] < current[1] else current
