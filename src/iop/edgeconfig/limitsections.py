"""`openai.limits` and `openai.limit_store`: what a principal may use (requests and tokens per
minute, requests at once, a token budget) and where those limits count."""

from __future__ import annotations

from typing import Annotated, Final, Literal, Self

from pydantic import model_validator

from .fields import (
    REDIS_URL_PATTERN,
    TIME_OF_DAY_PATTERN,
    EnvName,
    ModelId,
    Name,
    Spec,
    live,
    restart_edge,
)

#: `principal_ref` of a limit that applies to every principal, each on its own counters.
EVERY_PRINCIPAL: Final = "*"


class TokenBudget(Spec):
    """Tokens a principal may spend per day or per month; the count starts again at the reset."""

    tokens: Annotated[
        int,
        live(
            "Tokens (prompt + completion, as the upstream reports them) allowed per period; a "
            "request that would pass it is refused with 429 until the reset.",
            ge=1,
        ),
    ]
    period: Annotated[
        Literal["day", "month"],
        live("How often the count starts again: every day, or on the first day of each month."),
    ]
    reset_at: Annotated[
        str,
        live(
            "Time of day (HH:MM, UTC) at which the period starts: every day, or on the first "
            "day of the month. A change keeps what was spent in the period it moves.",
            pattern=TIME_OF_DAY_PATTERN,
        ),
    ] = "00:00"


class PrincipalLimit(Spec):
    """Bounds on what one principal (or one of its tokens, or its use of one model) may use.

    A request is held to every entry that selects it; each entry counts on its own.
    """

    principal_ref: Annotated[
        str,
        live(
            "The principal this entry bounds (a principal_ref of principal_tokens, or "
            "'anonymous'); '*' bounds every principal, each with counters of its own.",
            min_length=1,
        ),
    ]
    token_ref: Annotated[
        Name | None,
        live(
            "Only the requests of this token of the principal (its token_ref); null counts "
            "every token of the principal together."
        ),
    ] = None
    model: Annotated[
        ModelId | None,
        live(
            "Only the requests for this model id of the catalog (the model asked for); null "
            "counts every model together."
        ),
    ] = None
    requests_per_minute: Annotated[
        int | None,
        live(
            "Requests admitted per minute: a bucket of this many that refills continuously "
            "(this many per minute), so a burst may take the whole minute's worth at once.",
            ge=1,
        ),
    ] = None
    tokens_per_minute: Annotated[
        int | None,
        live(
            "Tokens (prompt + completion) per minute, refilled continuously: at admission the "
            "request's estimated prompt tokens are taken, and corrected to the usage the "
            "upstream reports when the answer ends.",
            ge=1,
        ),
    ] = None
    max_concurrent: Annotated[
        int | None,
        live(
            "Requests in progress at once (waiting for a slot or running), across the fleet "
            "when a limit_store is configured.",
            ge=1,
        ),
    ] = None
    budget: Annotated[
        TokenBudget | None,
        live("Tokens allowed per day or month, with its reset time; null means no budget."),
    ] = None

    @model_validator(mode="after")
    def _bounds_something(self) -> Self:
        if (
            self.requests_per_minute is None
            and self.tokens_per_minute is None
            and self.max_concurrent is None
            and self.budget is None
        ):
            raise ValueError(
                "sets no limit: give requests_per_minute, tokens_per_minute, max_concurrent "
                "or budget"
            )
        return self

    @property
    def list_key(self) -> str:
        """The entry's key in paths and hashes: principal|token_ref|model ('*' for none)."""
        return f"{self.principal_ref}|{self.token_ref or '*'}|{self.model or '*'}"


class LimitStoreSection(Spec):
    """Where the limits of `openai.limits` count: in each Edge process, or in a Redis every
    replica shares (docs/edge.md, "Limits per principal")."""

    url: Annotated[
        str,
        restart_edge(
            "redis://host:port/db (rediss:// for TLS) of a Redis the Edge replicas share, so "
            "every limit holds fleet-wide, budgets survive restarts and every replica finds "
            "the server that holds a stored response of the Responses API; empty means each "
            "Edge counts on its own (and knows only the responses answered through it). No "
            "credentials in it: see password_env.",
            pattern=REDIS_URL_PATTERN,
        ),
    ] = ""
    password_env: Annotated[
        EnvName | None,
        restart_edge("Environment variable that holds the Redis password (AUTH); null: none."),
    ] = None
    username: Annotated[
        str | None,
        restart_edge("Redis ACL user name (AUTH username password); null: the default user."),
    ] = None
    key_prefix: Annotated[
        str,
        restart_edge(
            "Prefix of every key the Edge writes, so several Edge fleets can share one Redis.",
            pattern=r"^[A-Za-z0-9._:-]{1,64}$",
        ),
    ] = "iop"
    timeout_ms: Annotated[
        int,
        restart_edge(
            "Milliseconds an admission waits for Redis; past it, or while Redis is "
            "unreachable, the Edge counts in its own process (each replica then holds the "
            "limits on its own) and says so in its log, metrics and GET /status.",
            ge=1,
            le=10_000,
        ),
    ] = 250
