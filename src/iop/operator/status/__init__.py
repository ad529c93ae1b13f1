"""The EdgeConfig's status: its model, how a pass's findings become it, and what is written.

- `model`: the status as pydantic models (also its CRD schema) and the kstatus conditions;
- `reporting`: a pass's findings turned into that status, with no I/O;
- `writing`: the status subresource written when it changed; `events`: Events, bounded.
"""

from .events import EventPoster
from .model import EdgeConfigStatus, LastChange
from .reporting import build_status, change_summary, now, reconciling_status
from .writing import StatusWriter

__all__ = [
    "EdgeConfigStatus",
    "EventPoster",
    "LastChange",
    "StatusWriter",
    "build_status",
    "change_summary",
    "now",
    "reconciling_status",
]
