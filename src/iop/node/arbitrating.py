"""Which config payload a Node runs when several Edge replicas each sent one.

Mid-rollout the Edge replicas disagree, and a Node that applied whichever payload came last
would flip between two at every push or reconnect. So a payload is known by its content hash
(`NodePayload.digest`; generations are one Edge's counters), the Node switches only when every
Edge it is connected to offers the same one (until then it keeps its payload and acknowledges
the new one as *pending*), and when no connected Edge offers the payload in use any more it
takes the one most of them offer (ties: the one offered last), since a payload no Edge stands
for would serve nobody's config. docs/reliability.md, "Payload consistency across Edge
replicas", says so for operators.
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
