"""The counters of `openai.limits[]` in a Redis every Edge replica shares (`openai.limit_store`).

One Lua script (`_SCRIPT`) does a whole admission atomically, with the rules of
`limits/rules.py` (the same refill arithmetic, the same order of checks, all or nothing), and
returns what it saw, so refusals and headers read as the in-process counters' would. A
request's end (`settle`) rides along with the next admission's write, or goes within 2 ms in one
pipeline, and is tried again until it lands or its lease expires. A place of `max_concurrent` is
a lease the replica renews while the request runs, which the store prunes once expired; an
admission whose call failed is cancelled by its lease id. Every Redis failure becomes
`LimitStoreError` here, once; the limiter then counts in its own process for a while. The same
store keeps which provider holds each stored response of the Responses API (`keep_home`,
`find_home`), so that every replica finds it: a write that rides along as an end does.
docs/edge.md, "Limits per principal" ("Across Edge replicas", "Inside the store"), says why a
shared store, and how its keys are kept; docs/reliability.md, "Shared limits when the store
stalls", what a stall costs; docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from iop.aiokits import LogThrottle, guarded_task, stop_tasks
from iop.edgeconfig import LimitStoreSection

from .redisclient import RedisClient, RedisError, ReplyError
from .rules import Check, Observed, ScopeUse, budget_period

logger = logging.getLogger(__name__)

#: Seconds between the renewals of a replica's leases (its places of requests in progress).
HEARTBEAT_S: Final = 5.0
#: Seconds a place is held past its last renewal: the store prunes it then by itself.
LEASE_S: Final = 15.0
#: How long a request's end is remembered in the store, so that a retry counts it once.
ENDED_TTL_S: Final = 2 * int(LEASE_S)

#: How long request ends wait for an admission to carry them before they go on their own.
SETTLE_DELAY_S: Final = 0.002
#: Seconds between tries of request ends that failed to reach the store.
SETTLE_RETRY_S: Final = 0.25
#: At most this many leases renewed in one script call.
_RENEW_BATCH: Final = 512
#: Seconds a response's home is kept in the store after it was recorded.
HOME_TTL_S: Final = 7 * 24 * 3600
#: Most home writes queued while the store does not answer (the oldest are dropped past it).
_MAX_NOTES: Final = 10_000

_NONE: Final = "-1"

_SCRIPT: Final = """
local now = tonumber(ARGV[1])
local estimate = tonumber(ARGV[2])
local lease = ARGV[3]
local prefix = ARGV[4]
local take = ARGV[5] == '1'
local n = tonumber(ARGV[6])
local expires = tonumber(ARGV[7])

-- a late run of an admission whose end (its cancel) came first takes nothing
if take and redis.call('EXISTS', prefix .. ':e:' .. lease) == 1 then take = false end

-- as rules._refill: a changed limit moves the level by the difference
local function refill(level, stamp, was, limit)
  if not level then return limit end
  local l = tonumber(level) + (limit - tonumber(was or limit))
  l = l + math.max(0, now - tonumber(stamp)) * limit / 60
  if l > limit then l = limit end
  return l
end

-- the leases of requests in progress, scored by expiry: expired ones go first
local function in_progress(key)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  return redis.call('ZCARD', key)
end

local seen = {}
local ok = true
for i = 0, n - 1 do
  local a = 8 + i * 8
  local scope = ARGV[a]
  local rpm, tpm, conc = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local budget, start = tonumber(ARGV[a + 4]), ARGV[a + 5]
  local b = redis.call('HMGET', prefix .. ':b:' .. scope, 'r', 'ra', 'rl', 't', 'ta', 'tl')
  local r, t, c, g = -1, -1, 0, 0
  if rpm > 0 then
    r = refill(b[1], b[2], b[3], rpm)
    if r < 1 then ok = false end
  end
  if tpm > 0 then
    t = refill(b[4], b[5], b[6], tpm)
    if estimate > tpm or t < math.max(estimate, 1) then ok = false end
  end
  if conc > 0 then
    -- and what the caller runs that the store does not count (admitted while it failed)
    c = in_progress(prefix .. ':l:' .. scope) + tonumber(ARGV[a + 7])
    if c >= conc then ok = false end
  end
  if budget > 0 then
    g = tonumber(redis.call('GET', prefix .. ':g:' .. scope .. ':' .. start) or '0')
    if estimate > budget or g + estimate > budget or g >= budget then ok = false end
  end
  seen[i + 1] = {r, t, c, g}
end

if ok and take then
  for i = 0, n - 1 do
    local a = 8 + i * 8
    local scope = ARGV[a]
    local rpm, tpm, conc = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    local budget, start, ends = tonumber(ARGV[a + 4]), ARGV[a + 5], tonumber(ARGV[a + 6])
    local s = seen[i + 1]
    local bkey = prefix .. ':b:' .. scope
    local ttl = 0
    if rpm > 0 then
      s[1] = s[1] - 1
      redis.call('HSET', bkey, 'r', tostring(s[1]), 'ra', tostring(now), 'rl', rpm)
      ttl = math.max(ttl, (rpm - s[1]) * 60 / rpm)
    end
    if tpm > 0 then
      s[2] = s[2] - estimate
      redis.call('HSET', bkey, 't', tostring(s[2]), 'ta', tostring(now), 'tl', tpm)
      ttl = math.max(ttl, (tpm - s[2]) * 60 / tpm)
    end
    if ttl > 0 then redis.call('EXPIRE', bkey, math.ceil(ttl) + 1) end
    if conc > 0 then
      local lkey = prefix .. ':l:' .. scope
      redis.call('ZADD', lkey, expires, lease)
      redis.call('EXPIRE', lkey, math.ceil(expires - now) + 1)
      s[3] = s[3] + 1
    end
    if budget > 0 then
      local gkey = prefix .. ':g:' .. scope .. ':' .. start
      s[4] = redis.call('INCRBY', gkey, estimate)
      redis.call('EXPIREAT', gkey, ends + 86400)
    end
  end
end

local out = {ok and 1 or 0}
for i = 1, n do
  local s = seen[i]
  out[#out + 1] = tostring(s[1])
  out[#out + 1] = tostring(s[2])
  out[#out + 1] = s[3]
  out[#out + 1] = s[4]
end
return out
"""

# A request's end: its places given back (every time: a repeat frees nothing twice), its token
# correction counted once (the `:e:` mark; a retry after a lost reply finds it). A cancel (an
# admission whose call failed) only frees, and its mark keeps a late run from taking.
_SETTLE: Final = """
local now = tonumber(ARGV[1])
local lease = ARGV[2]
local prefix = ARGV[3]
local cancel = ARGV[4] == '1'
local n = tonumber(ARGV[5])
local first = redis.call('SET', prefix .. ':e:' .. lease, '1', 'NX', 'EX', ARGV[6])
local count = first and not cancel
for i = 0, n - 1 do
  local a = 7 + i * 6
  local scope = ARGV[a]
  local tpm, conc, budget = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local start, delta = ARGV[a + 4], tonumber(ARGV[a + 5])
  if count and tpm > 0 and delta ~= 0 then
    local bkey = prefix .. ':b:' .. scope
    local b = redis.call('HMGET', bkey, 't', 'ta', 'tl')
    local level = tpm
    if b[1] then
      level = tonumber(b[1]) + (tpm - tonumber(b[3] or tpm))
      level = level + math.max(0, now - tonumber(b[2])) * tpm / 60
      if level > tpm then level = tpm end
    end
    level = level - delta
    redis.call('HSET', bkey, 't', tostring(level), 'ta', tostring(now), 'tl', tpm)
    redis.call('EXPIRE', bkey, math.ceil(math.max(60, (tpm - level) * 60 / tpm)) + 1)
  end
  if conc > 0 then
    redis.call('ZREM', prefix .. ':l:' .. scope, lease)
  end
  if count and budget > 0 and delta ~= 0 then
    local gkey = prefix .. ':g:' .. scope .. ':' .. start
    if redis.call('EXISTS', gkey) == 1 and redis.call('INCRBY', gkey, delta) < 0 then
      redis.call('SET', gkey, '0', 'KEEPTTL')
    end
  end
end
return n
"""

# The leases of requests still in progress, held for another LEASE_S (only those still there:
# an end that came first is not undone).
_RENEW: Final = """
local prefix = ARGV[1]
local expires = ARGV[2]
local ttl = tonumber(ARGV[3])
for i = 4, #ARGV, 2 do
  local key = prefix .. ':l:' .. ARGV[i]
  if redis.call('ZSCORE', key, ARGV[i + 1]) then
    redis.call('ZADD', key, expires, ARGV[i + 1])
    redis.call('EXPIRE', key, ttl)
  end
end
return 1
"""


class LimitStoreError(Exception):
    """The shared store could not answer (unreachable, too slow, refused)."""


@dataclass(frozen=True, slots=True)
class _Settlement:
    lease: str
    checks: tuple[Check, ...]
    taken: int
    spent: int
    started: float
    now: float
    #: Past this (the lease's expiry) the store has freed the place by itself: no more tries.
    until: float
    #: An admission whose call failed: free what a late run of it may take, count nothing.
    cancel: bool = False


class RedisCounters:
    """The counters of every scope, in Redis; `start()` connects, `stop()` closes."""

    def __init__(
        self, section: LimitStoreSection, replica_id: str, clock: Callable[[], float] = time.time
    ) -> None:
        password = os.environ.get(section.password_env) if section.password_env else None
        self._redis = RedisClient(
            section.url,
            username=section.username,
            password=password,
            timeout=section.timeout_ms / 1000,
        )
        self._url = section.url
        self._prefix = section.key_prefix
        self._replica = replica_id
        self._clock = clock
        self._admit = self._redis.script(_SCRIPT)
        self._settle = self._redis.script(_SETTLE)
        self._renew = self._redis.script(_RENEW)
        self._ids = itertools.count()
        #: The leases of requests in progress that hold places: their scopes and expiry.
        self._held: dict[str, tuple[tuple[str, ...], float]] = {}
        self._pending: list[_Settlement] = []
        #: Plain writes (a response's home) that ride along with the next pipeline.
        self._notes: list[tuple[Any, ...]] = []
        self._wake = asyncio.Event()
        self._sending = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._errors = LogThrottle(logger)
        self._late = LogThrottle(logger)
        self.connected = False

    @property
    def url(self) -> str:
        return self._url

    async def start(self) -> None:
        self._tasks = [
            guarded_task(self._beat(), name="edge-limits-heartbeat", logger=logger),
            guarded_task(self._flush(), name="edge-limits-settle", logger=logger),
        ]

    async def stop(self) -> None:
        # The tasks end on their own (a cancellation in the middle of a pipeline is safe, but
        # an end in flight would be left to its lease); cancelling is the last resort.
        self._stopping.set()
        self._wake.set()
        tasks, self._tasks = self._tasks, []
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=LEASE_S)
            await stop_tasks(late)
        await self._send_pending()
        await self._redis.close()

    async def admit(
        self,
        checks: Sequence[Check],
        estimate: int,
        now: float,
        *,
        take: bool = True,
        unshared: Sequence[int] = (),
    ) -> tuple[bool, list[Observed], str]:
        """Take what the request needs from every check, or nothing; what each one holds, and
        the request's lease (for `settle`). `unshared`: per check, the requests in progress that
        this process admitted on its own, which the store counts as in progress too."""
        lease = f"{self._replica}:{next(self._ids)}"
        expires = now + LEASE_S
        args: list[Any] = [now, estimate, lease, self._prefix, 1 if take else 0, len(checks)]
        args.append(expires)
        for index, check in enumerate(checks):
            rule = check.rule
            start, end = budget_period(rule.budget, now) if rule.budget else (0, 0)
            args += [
                check.scope,
                rule.requests_per_minute or _NONE,
                rule.tokens_per_minute or _NONE,
                rule.max_concurrent or _NONE,
                rule.budget.tokens if rule.budget else _NONE,
                start,
                end,
                unshared[index] if unshared else 0,
            ]
        # Request ends waiting to be sent go in the same write (one round trip for both).
        ended = self._take_pending()
        notes = self._take_notes()
        commands = [
            *notes,
            *self._settle_commands(ended),
            self._redis.evalsha_command(self._admit, args),
        ]
        try:
            reply = (await self._pipeline(commands))[-1]
        except (RedisError, LimitStoreError) as exc:
            self._pending[:0] = ended  # tried again with the next admission or by the flusher
            self._put_back(notes)
            if take:  # Redis may still run it when it wakes: what it takes is given back
                self._pending.append(
                    _Settlement(lease, tuple(checks), 0, 0, now, now, expires, cancel=True)
                )
                self._wake.set()
            raise LimitStoreError(str(exc)) from exc
        if isinstance(reply, ReplyError):
            raise LimitStoreError(f"refused: {reply}")
        self.connected = True
        states = []
        for index, check in enumerate(checks):
            requests, tokens, in_progress, spent = reply[1 + index * 4 : 5 + index * 4]
            rule = check.rule
            states.append(
                Observed(
                    requests=float(requests) if rule.requests_per_minute else None,
                    tokens=float(tokens) if rule.tokens_per_minute else None,
                    in_progress=int(in_progress),
                    budget_spent=int(spent),
                )
            )
        admitted = reply[0] == 1
        if admitted and take:
            scopes = tuple(check.scope for check in checks if check.rule.max_concurrent)
            if scopes:
                self._held[lease] = (scopes, expires)
        return admitted, states, lease

    def settle(
        self,
        lease: str,
        checks: tuple[Check, ...],
        taken: int,
        spent: int,
        started: float,
        now: float,
    ) -> None:
        """Queue a request's end (its token correction, its place given back): it is sent until
        it lands or its lease expires."""
        held = self._held.pop(lease, None)
        until = held[1] if held is not None else now + LEASE_S
        self._pending.append(_Settlement(lease, checks, taken, spent, started, now, until))
        self._wake.set()

    # -- where stored responses live (the Responses API) --------------------------------------

    def keep_home(self, response_id: str, home: str) -> None:
        """Record where a stored response lives (`home`: its provider and model, as text), for
        `HOME_TTL_S`; the write rides along with the next pipeline."""
        self._notes.append(("SET", self._home_key(response_id), home, "EX", HOME_TTL_S))
        self._wake.set()

    def forget_home(self, response_id: str) -> None:
        self._notes.append(("DEL", self._home_key(response_id)))
        self._wake.set()

    async def find_home(self, response_id: str) -> str | None:
        """Where a stored response lives, as some replica recorded it; None when none did."""
        try:
            found = await self._redis.call("GET", self._home_key(response_id))
        except RedisError as exc:
            raise LimitStoreError(str(exc)) from exc
        return found.decode() if isinstance(found, bytes) else None

    def _home_key(self, response_id: str) -> str:
        return f"{self._prefix}:h:{response_id}"

    def _take_notes(self) -> list[tuple[Any, ...]]:
        notes, self._notes = self._notes, []
        return notes

    def _put_back(self, notes: list[tuple[Any, ...]]) -> None:
        self._notes[:0] = notes
        if len(self._notes) > _MAX_NOTES:
            del self._notes[: len(self._notes) - _MAX_NOTES]

    async def use(self, checks: Sequence[Check], now: float) -> list[ScopeUse]:
        _, states, _ = await self.admit(checks, 0, now, take=False)
        result = []
        for check, state in zip(checks, states, strict=True):
            budget = check.rule.budget
            resets = budget_period(budget, now)[1] if budget is not None else None
            result.append(
                ScopeUse(
                    requests_available=state.requests,
                    tokens_available=state.tokens,
                    in_progress=state.in_progress,
                    budget_used=state.budget_spent if budget is not None else None,
                    budget_resets_at=resets,
                )
            )
        return result

    # -- background ----------------------------------------------------------------------------

    async def _beat(self) -> None:
        """Renew the leases of this replica's requests in progress (the store frees the places
        of a replica that stopped renewing within LEASE_S)."""
        while not self._stopping.is_set():
            try:
                await self._renew_leases()
            except (RedisError, LimitStoreError) as exc:
                self.connected = False
                self._errors.warning("the limit store %s is unreachable: %r", self._url, exc)
            else:
                self.connected = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), HEARTBEAT_S)

    async def _renew_leases(self) -> None:
        expires = self._clock() + LEASE_S
        held = list(self._held.items())
        # The expiry as if it landed: an end is tried until the latest the store may hold it.
        for lease, (scopes, _) in held:
            self._held[lease] = (scopes, expires)
        commands = []
        for first in range(0, max(1, len(held)), _RENEW_BATCH):
            args: list[Any] = [self._prefix, expires, math.ceil(LEASE_S) + 1]
            for lease, (scopes, _) in held[first : first + _RENEW_BATCH]:
                for scope in scopes:
                    args += [scope, lease]
            commands.append(self._redis.evalsha_command(self._renew, args))
        replies = await self._pipeline(commands)
        failed = [reply for reply in replies if isinstance(reply, ReplyError)]
        if failed:
            raise LimitStoreError(f"refused: {failed[0]}")

    async def drain(self) -> None:
        """Until every request end queued so far is counted in Redis (or failed, this time)."""
        await self._send_pending()

    async def _flush(self) -> None:
        while not self._stopping.is_set():
            await self._wake.wait()
            self._wake.clear()
            # A moment for the next admission to take them along in its own write.
            await asyncio.sleep(SETTLE_DELAY_S)
            if not await self._send_pending():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), SETTLE_RETRY_S)
                self._wake.set()

    async def _send_pending(self) -> bool:
        """Send the request ends queued; False when they failed to land (they stay queued)."""
        async with self._sending:
            notes = self._take_notes()
            if notes:
                try:
                    await self._redis.pipeline(notes)
                except RedisError as exc:
                    self._put_back(notes)
                    self._errors.warning(
                        "%d response homes wait for the limit store (%s)", len(notes), exc
                    )
                    return False
            batch = self._take_pending()
            now = self._clock()
            live = [item for item in batch if item.until > now]
            if len(live) < len(batch):
                self._late.warning(
                    "%d request ends could not reach the limit store before their leases "
                    "expired: their places came back by themselves, their token corrections "
                    "were not counted there",
                    len(batch) - len(live),
                )
            if not live:
                return True
            try:
                await self._send(live)
            except LimitStoreError as exc:
                self._pending[:0] = live
                self._errors.warning(
                    "%d request ends wait for the limit store (%s): tried again until they "
                    "land or their leases expire",
                    len(live),
                    exc,
                )
                return False
            return True

    def _take_pending(self) -> list[_Settlement]:
        batch, self._pending = self._pending, []
        return batch

    def _settle_commands(self, batch: list[_Settlement]) -> list[tuple[Any, ...]]:
        commands = []
        for item in batch:
            args: list[Any] = [item.now, item.lease, self._prefix, 1 if item.cancel else 0]
            args += [len(item.checks), ENDED_TTL_S]
            for check in item.checks:
                rule = check.rule
                start = budget_period(rule.budget, item.started)[0] if rule.budget else 0
                args += [
                    check.scope,
                    rule.tokens_per_minute or _NONE,
                    rule.max_concurrent or _NONE,
                    rule.budget.tokens if rule.budget else _NONE,
                    start,
                    item.spent - item.taken,
                ]
            commands.append(self._redis.evalsha_command(self._settle, args))
        return commands

    async def _pipeline(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """The replies, after loading the scripts again if Redis lost them (a restart)."""
        replies = await self._redis.pipeline(commands)
        if any(isinstance(r, ReplyError) and str(r).startswith("NOSCRIPT") for r in replies):
            await self._redis.load_scripts()
            replies = await self._redis.pipeline(commands)
        return replies

    async def _send(self, batch: list[_Settlement]) -> None:
        try:
            replies = await self._pipeline(self._settle_commands(batch))
        except RedisError as exc:
            raise LimitStoreError(str(exc)) from exc
        failed = [reply for reply in replies if isinstance(reply, ReplyError)]
        if failed:
            raise LimitStoreError(f"{len(failed)} refused: {failed[0]}")
