"""The verdict on a config change by what it served: pure, shared by the Edge and the operator.

- `figures`: `Figures`, what some requests came to (counts, first-token and duration buckets),
  which subtract and add exactly;
- `judging`: `judge` (a change applied to all, or an Edge restart's new pod) and `judge_step` (a
  canary's step), the candidate's figures against the baseline's by the rules of `rollout`.

The Edge judges its canaries with them (`iop.edge.refresh`); the operator holds an Edge
restart's new pod to the old pods with them (`iop.operator.gating`). docs/rollout.md has the
checks and their defaults.
"""

from .figures import DURATION_BOUNDS, FIRST_TOKEN_BOUNDS, Figures
from .judging import Judgement, judge, judge_step

__all__ = [
    "DURATION_BOUNDS",
    "FIRST_TOKEN_BOUNDS",
    "Figures",
    "Judgement",
    "judge",
    "judge_step",
]
