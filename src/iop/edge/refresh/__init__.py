"""A live refresh: load, validate, classify, then swap the snapshot and push to the Nodes.

- `refresher`: the `Refresher`, the config in use and the last reports;
- `reports`: a refresh's report and its parts; `configfiles`: which files a refresh may read;
- `rollouts`: each change a revision (`revisions`), put on trial (a canary or all at once, as
  `iop.edgeconfig.plan_trial` plans it), watched and judged (`iop.verdicts`) while it serves, rolled
  back when it hurts.
"""

from .configfiles import ConfigFileRefused
from .refresher import Refresher
from .reports import ConfigSource, RefreshReport
from .rollouts import NoCandidate, RolloutCollector

__all__ = [
    "ConfigFileRefused",
    "ConfigSource",
    "NoCandidate",
    "RefreshReport",
    "Refresher",
    "RolloutCollector",
]
