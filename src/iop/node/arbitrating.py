"""Which config payload a Node runs when several Edge replicas each sent one.

Every Edge replica pushes the Node's payload on its own. Mid-rollout they disagree: the operator
refreshes one replica, then the next, and a replica that restarts welcomes the Node with its
config. A Node that applied whichever payload came last would flip between the two at every
push or reconnect. The rule:

- A payload is known by its content hash (`NodePayload.digest`); generations are counters of one
  Edge each and say nothing across replicas, so they never decide.
- The Node switches to a payload only when every Edge it is connected to offers that same one.
  Until then it keeps the payload in use, and acknowledges the new one as *pending*.
- When no connected Edge offers the payload in use any more (those Edges went away), the Node
  takes the payload most of them offer (ties: the one offered last), since keeping a payload no
  Edge stands for would serve nobody's config.

So replicas that disagree never flip the Node, and it converges as soon as they agree.
"""

from __future__ import annotations

import logging
from collections import Counter

from iop.edgeconfig import NodePayload
from iop.providers import Runner

logger = logging.getLogger(__name__)


class PayloadArbiter:
    """Collects each connected Edge's payload and applies the one the rule picks."""

    def __init__(self, runner: Runner) -> None:
        self._runner = runner
        #: Edge address -> (payload, digest, order of the offer).
        self._offers: dict[str, tuple[NodePayload, str, int]] = {}
        self._order = 0

    @property
    def in_use(self) -> str:
        """The digest of the payload in use ("" before any)."""
        return self._runner.registry.digest

    def offer(self, edge: str, payload: NodePayload, digest: str) -> bool:
        """Edge `edge` sends `payload`; True when it is in use after this call."""
        self._order += 1
        self._offers[edge] = (payload, digest, self._order)
        self._decide()
        return self.in_use == digest

    def withdraw(self, edge: str) -> None:
        """Edge `edge` disconnected: its payload no longer counts."""
        if self._offers.pop(edge, None) is not None:
            self._decide()

    def _decide(self) -> None:
        offers = self._offers
        if not offers:
            return
        current = self.in_use
        digests = {digest for _, digest, _ in offers.values()}
        if len(digests) == 1:
            (chosen,) = digests
        elif current in digests:
            return  # the Edges disagree: keep what runs
        else:
            counts = Counter(digest for _, digest, _ in offers.values())
            latest = {digest: order for _, digest, order in offers.values()}
            chosen = max(digests, key=lambda digest: (counts[digest], latest[digest]))
        if chosen == current:
            return
        payload = next(p for p, digest, _ in offers.values() if digest == chosen)
        if current and len(digests) > 1:
            logger.info(
                "no connected Edge offers config %s any more: switching to %s",
                current[:12],
                chosen[:12],
            )
        self._runner.apply(payload, chosen)
