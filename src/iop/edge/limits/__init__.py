"""`openai.limits[]`: requests and tokens per principal, counted here or in a shared Redis.

- `rules`: the limits as rules and their verdicts, with no I/O, and the in-process counters;
- `limiter`: the `Limiter`, which admits a request (or refuses it 429) and settles its end;
- `rediscounters`: the same counters in Redis, for a fleet; `redisclient`: a lean Redis client.
"""

from .limiter import NO_GRANT, Grant, Limiter

__all__ = ["NO_GRANT", "Grant", "Limiter"]
