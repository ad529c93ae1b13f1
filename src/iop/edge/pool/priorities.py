"""Priority classes: the class a request waits in, and what each class's requests came to.

`PriorityTable`, built with the pool snapshot from `openai.priority`, gives one request its
`Priority`: its principal's class, else its model's, else the default; lowered by the request's
`x-iop-priority-class` header where the principal may (never raised); with the wait bound of its
class or of its `x-iop-max-queue-wait-ms` header, whichever is shorter. `ClassTally` keeps per
class what the dispatcher did with them (admitted, queued, shed by reason, queue waits) as plain
numbers that the metrics read when scraped. docs/edge.md, "Priority classes", has the rules.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from iop.edgeconfig import DEFAULT_PRIORITY_CLASS, EdgeConfig

from ..errors import BadRequest, Forbidden

#: The header that puts one request in a lower class than its principal's.
CLASS_HEADER: Final = b"x-iop-priority-class"
#: The header that bounds one request's wait in a queue, in milliseconds.
MAX_WAIT_HEADER: Final = b"x-iop-max-queue-wait-ms"
#: The largest wait a request may ask for (an hour, as a class's `max_queue_wait_ms`).
_MAX_WAIT_MS: Final = 3_600_000

#: Why a request of a class got no slot (the `reason` label of `iop_edge_class_shed_total`).
SATURATED: Final = "saturated"
DISPLACED: Final = "displaced"
QUEUE_FULL: Final = "queue_full"
CLASS_WAIT: Final = "class_wait"
REQUEST_WAIT: Final = "request_wait"
QUEUE_TIMEOUT: Final = "queue_timeout"

#: Upper bounds of the queue-wait histogram per class, in seconds.
WAIT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class Priority:
    """Where one request stands in a queue: its class, the class's priority, and how long it may
    wait (None: as long as its providers' queue_timeout_ms) and what set that bound."""

    class_name: str
    level: int
    max_wait_s: float | None = None
    #: The reason a wait that ran out gives: a class's bound or the request's own header.
    wait_source: str = ""

    @property
    def sheddable(self) -> bool:
        """Refused at a saturated model instead of queued (a negative priority)."""
        return self.level < 0


#: The class of every request of a config that names none: today's behaviour.
DEFAULT_PRIORITY: Final = Priority(DEFAULT_PRIORITY_CLASS, 0)


def _class_priority(name: str, level: int, max_wait_ms: int) -> Priority:
    return Priority(
        name, level, max_wait_ms / 1000, f"class `{name}`'s max_queue_wait_ms ({max_wait_ms})"
    )


class PriorityTable:
    """`openai.priority` of one config, ready to answer a request's class."""

    __slots__ = (
        "_by_model",
        "_by_principal",
        "_default",
        "_fixed",
        "classes",
        "queue_depth",
        "server_waiting",
    )

    def __init__(self, config: EdgeConfig) -> None:
        section = config.openai.priority
        classes = {DEFAULT_PRIORITY_CLASS: DEFAULT_PRIORITY}
        for spec in section.classes:
            classes[spec.name] = _class_priority(spec.name, spec.priority, spec.max_queue_wait_ms)
        #: Every class by name, the built-in `default` among them.
        self.classes: Mapping[str, Priority] = classes
        #: A server with this many requests waiting of its own is full for a sheddable request.
        self.server_waiting = section.saturation.server_waiting
        #: A model with this many requests waiting at this Edge is saturated.
        self.queue_depth = section.saturation.queue_depth
        self._default = classes[section.default_class or DEFAULT_PRIORITY_CLASS]
        self._by_principal = {
            entry.principal_ref: (classes[entry.priority_class], entry.lower_per_request)
            for entry in section.principals
        }
        self._by_model = {
            name: classes[model.priority_class]
            for model in config.models
            if model.priority_class is not None
            for name in (model.id, *model.adapters)  # an adapter takes its model's class
        }
        #: Every request gets the default class unless it asks otherwise (no class named).
        self._fixed = not self._by_principal and not self._by_model

    def resolve(
        self,
        principal_ref: str,
        model_id: str,
        asked: bytes | None = None,
        max_wait_ms: bytes | None = None,
    ) -> Priority:
        """The request's `Priority`; `asked`, `max_wait_ms`: its two headers' values, if sent.

        Raises `BadRequest` for a header that names no class or no valid wait, `Forbidden` for a
        class above the principal's or a principal that may not choose.
        """
        lower = True
        if self._fixed:
            own = self._default
        else:
            entry = self._by_principal.get(principal_ref)
            if entry is not None:
                own, lower = entry
            else:
                own = self._by_model.get(model_id, self._default)
        priority = own if asked is None else self._lowered(own, asked, lower, principal_ref)
        if max_wait_ms is None:
            return priority
        return self._bounded(priority, max_wait_ms)

    def _lowered(self, own: Priority, asked: bytes, lower: bool, principal_ref: str) -> Priority:
        name = asked.decode("latin-1").strip()
        chosen = self.classes.get(name)
        if chosen is None:
            known = ", ".join(sorted(self.classes))
            raise BadRequest(
                f"x-iop-priority-class: unknown priority class {name!r} (known: {known}).",
                param=CLASS_HEADER.decode(),
            )
        if chosen is own:
            return own
        if not lower:
            raise Forbidden(
                f"x-iop-priority-class: principal `{principal_ref}` may not choose its requests' "
                f"class (openai.priority.principals[{principal_ref}].lower_per_request is false); "
                f"its class is `{own.class_name}`.",
                code="priority_class_not_allowed",
            )
        if chosen.level > own.level:
            raise Forbidden(
                f"x-iop-priority-class: class `{chosen.class_name}` (priority {chosen.level}) is "
                f"above `{own.class_name}` (priority {own.level}), the class of principal "
                f"`{principal_ref}`: a request may only lower its class.",
                code="priority_class_not_allowed",
            )
        return chosen

    @staticmethod
    def _bounded(priority: Priority, max_wait_ms: bytes) -> Priority:
        text = max_wait_ms.decode("latin-1").strip()
        if not text.isdigit() or not 1 <= int(text) <= _MAX_WAIT_MS:
            raise BadRequest(
                f"x-iop-max-queue-wait-ms: must be a whole number of milliseconds from 1 to "
                f"{_MAX_WAIT_MS}, got {text[:32]!r}.",
                param=MAX_WAIT_HEADER.decode(),
            )
        wait_s = int(text) / 1000
        if priority.max_wait_s is not None and priority.max_wait_s <= wait_s:
            return priority
        return Priority(
            priority.class_name,
            priority.level,
            wait_s,
            f"the request's x-iop-max-queue-wait-ms ({text})",
        )


class _Waits:
    """A histogram of queue waits: counts per bucket of `WAIT_BUCKETS` (and one past them)."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(WAIT_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(WAIT_BUCKETS, seconds)] += 1
        self.total += seconds


class ClassTally:
    """What each class's requests came to at the dispatcher, since the Edge started."""

    __slots__ = ("admitted", "came_back", "queued", "shed", "waits")

    def __init__(self) -> None:
        #: class -> requests given a slot (at once or after waiting).
        self.admitted: dict[str, int] = {}
        #: class -> requests that waited in a queue.
        self.queued: dict[str, int] = {}
        #: (class, reason) -> requests that got no slot, by reason.
        self.shed: dict[tuple[str, str], int] = {}
        #: class -> the waits of its requests that were given a slot after waiting.
        self.waits: dict[str, _Waits] = {}
        #: class -> shed requests that came back when told and were queued though the model
        #: was still saturated (the dispatcher's promises kept).
        self.came_back: dict[str, int] = {}

    def admit(self, priority: Priority, waited_s: float | None = None) -> None:
        name = priority.class_name
        self.admitted[name] = self.admitted.get(name, 0) + 1
        if waited_s is not None:
            waits = self.waits.get(name)
            if waits is None:
                waits = self.waits[name] = _Waits()
            waits.observe(waited_s)

    def queue(self, priority: Priority) -> None:
        name = priority.class_name
        self.queued[name] = self.queued.get(name, 0) + 1

    def come_back(self, priority: Priority) -> None:
        name = priority.class_name
        self.came_back[name] = self.came_back.get(name, 0) + 1

    def refuse(self, priority: Priority, reason: str) -> None:
        key = (priority.class_name, reason)
        self.shed[key] = self.shed.get(key, 0) + 1
