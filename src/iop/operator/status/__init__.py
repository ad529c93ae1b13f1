"""The EdgeConfig's status: its model, how a pass's findings become it, and what is written.

- `model`: the status as pydantic models (also its CRD schema) and the kstatus conditions;
- `reporting`: a pass's findings turned into that status, with no I/O;
- `writing`: the status subresource written when it changed; `events`: Events, bounded.
"""

from .events import EventPoster
from .model import (
    FINAL_OUTCOMES,
    GOOD_OUTCOMES,
    EdgeConfigStatus,
    HistoryEntry,
    LastChange,
    RestartPathEntry,
    RevisionOutcome,
    RevisionRollout,
)
from .reporting import build_status, change_summary, now, read_history, reconciling_status
from .writing import StatusWriter

__all__ = [
    "FINAL_OUTCOMES",
    "GOOD_OUTCOMES",
    "EdgeConfigStatus",
    "EventPoster",
    "HistoryEntry",
    "LastChange",
    "RestartPathEntry",
    "RevisionOutcome",
    "RevisionRollout",
    "StatusWriter",
    "build_status",
    "change_summary",
    "now",
    "read_history",
    "reconciling_status",
]
