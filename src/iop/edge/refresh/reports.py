"""The values of a live refresh: the candidate config as it arrived, and the report of one refresh.

A `RefreshReport` is what `POST /refresh` answers, what `GET /refresh/last` shows, what `iop edge
reload` prints and what SIGHUP logs, so it is one shape everywhere. Its lists are tuples that
are never None (empty when nothing applies), and `as_dict()` keeps them lists, never null.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from iop.edgeconfig import ChangeReport, EdgeConfig, Problem

#: dry_run: judge the candidate and change nothing; apply: swap it in and push it.
Mode = Literal["dry_run", "apply"]
#: applied: swapped in; valid: a dry run that could apply live; restart_required: some path
#: needs a restart (an apply is refused and changes nothing); invalid: the candidate does not load;
#: rolled_back: an apply refused because this very config was rolled back since the stable
#: revision came into effect (docs/rollout.md).
Outcome = Literal["applied", "valid", "restart_required", "invalid", "rolled_back"]
#: acked: the node applied the payload (or holds it until every Edge it serves sends it: the
#: reason says so); failed: it refused, went away or did not answer in time;
#: not_connected: it was not connected, and receives the current payload when it connects;
#: held: not pushed, because the caller restarts the node to take it (`restarting`); the node
#: receives it when it connects again.
PushStatus = Literal["acked", "failed", "not_connected", "held"]


@dataclass(frozen=True, slots=True)
class ConfigSource:
    """A config offered for a refresh: a parsed document or model, YAML (or JSON) text, or a file.

    Exactly one of the three is set; use the constructors.
    """

    data: object = None
    text: str | None = None
    path: Path | None = None
    #: What to call a parsed document in the log and the report (a revision's config).
    label: str = ""

    @classmethod
    def of_data(cls, data: Any, label: str = "") -> ConfigSource:
        """A parsed document (a mapping, as in a JSON body) or an `EdgeConfig`."""
        return cls(data=data, label=label)

    @classmethod
    def of_text(cls, text: str) -> ConfigSource:
        return cls(text=text)

    @classmethod
    def of_path(cls, path: str | Path) -> ConfigSource:
        return cls(path=Path(path))

    def describe(self) -> str:
        """Where the candidate came from, for the log and the report (never its content)."""
        if self.path is not None:
            return f"file {self.path}"
        if self.text is not None:
            return f"YAML text ({len(self.text.encode())} bytes)"
        if self.label:
            return self.label
        return "config model" if isinstance(self.data, EdgeConfig) else "config object"


@dataclass(frozen=True, slots=True)
class NodePush:
    """What became of one node's payload push."""

    node_id: str
    status: PushStatus
    #: Why it failed or was not sent; empty when acked.
    reason: str = ""
    #: The generation pushed, and the digest of the node payload (what the node acknowledges).
    generation: int = 0
    config_hash: str = ""

    def as_dict(self) -> dict[str, object]:
        return {
            "node_id": self.node_id,
            "status": self.status,
            "reason": self.reason,
            "generation": self.generation,
            "config_hash": self.config_hash,
        }


@dataclass(frozen=True, slots=True)
class RefreshReport:
    """The result of one dry run or apply. Lists are sorted tuples and never None."""

    mode: Mode
    outcome: Outcome
    #: True only when this refresh swapped the candidate in.
    applied: bool
    previous_config_hash: str
    previous_generation: int
    #: The candidate's hash (None when it did not load) and the generation in use afterwards.
    config_hash: str | None
    generation: int
    #: What changed between the config in use and the candidate (empty when it did not load).
    change: ChangeReport = field(default_factory=ChangeReport)
    #: Restart scopes (`node:<id>`) the caller restarts itself: their paths did not refuse the
    #: apply, and those nodes were not pushed to.
    restarting: tuple[str, ...] = ()
    pushes: tuple[NodePush, ...] = ()
    problems: tuple[Problem, ...] = ()
    #: Who asked (peer address and auth, or the signal), and what was offered.
    requested_by: str = ""
    source: str = ""
    #: Unix time the refresh started, and how long it took (apply: until the last ack).
    started_at: float = 0.0
    duration_ms: float = 0.0
    message: str = ""
    #: The revision an apply that changed something became (0: none; see `revisions.py`).
    revision: int = 0

    @property
    def all_acked(self) -> bool:
        """Every node pushed to acknowledged (vacuously true when nothing was pushed; a node
        held for its restart was not pushed to)."""
        return all(push.status in ("acked", "held") for push in self.pushes)

    def as_dict(self) -> dict[str, object]:
        """The admin API's JSON: the change report's fields at the top level, beside the rest."""
        return {
            "mode": self.mode,
            "outcome": self.outcome,
            "applied": self.applied,
            "message": self.message,
            "previous_config_hash": self.previous_config_hash,
            "previous_generation": self.previous_generation,
            "config_hash": self.config_hash,
            "generation": self.generation,
            "revision": self.revision,
            **self.change.as_dict(),
            "restarting": list(self.restarting),
            "pushes": [push.as_dict() for push in self.pushes],
            "problems": [problem.as_dict() for problem in self.problems],
            "requested_by": self.requested_by,
            "source": self.source,
            "started_at": self.started_at,
            "duration_ms": self.duration_ms,
        }
