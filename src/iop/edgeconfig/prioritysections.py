"""`openai.priority`: the priority classes, which principal's requests take which, and when a
model counts as saturated for a sheddable request."""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import Field

from .fields import Name, Spec, live

#: The priority class of every request of a config that names none (`openai.priority`).
DEFAULT_PRIORITY_CLASS: Final = "default"


class PriorityClass(Spec):
    """A priority class: the order its requests wait in, whether they may be shed, and how long
    they may wait (docs/edge.md, "Priority classes")."""

    name: Annotated[
        Name,
        live(
            "The class's name, as openai.priority.principals[], models[].priority_class and "
            "a request's x-iop-priority-class header name it."
        ),
    ]
    priority: Annotated[
        int,
        live(
            "Higher is served first: a waiting request of a higher priority always takes a "
            "freed slot before one of a lower priority, whenever each arrived; within one "
            "priority, principals share by their principal_weights. Below 0 the class is "
            "sheddable: at a saturated model its requests get 429 model_saturated at once "
            "instead of a place in the queue, and a full queue gives their places to higher "
            "priorities.",
            ge=-1000,
            le=1000,
        ),
    ]
    max_queue_wait_ms: Annotated[
        int,
        live(
            "Longest a request of this class waits in a model's queue; past it the request "
            "leaves the queue with 504 queue_wait_exceeded, before it reaches a server. The "
            "providers' queue_timeout_ms still ends the wait (503 queue_timeout) when it is "
            "shorter.",
            ge=1,
            le=3_600_000,
        ),
    ] = 30_000

    @property
    def list_key(self) -> str:
        return self.name


class PrincipalPriority(Spec):
    """The priority class of one principal's requests."""

    principal_ref: Annotated[
        str,
        live("The principal (a principal_ref of principal_tokens, or 'anonymous').", min_length=1),
    ]
    priority_class: Annotated[
        Name, live("The class of the principal's requests (a name of openai.priority.classes).")
    ]
    lower_per_request: Annotated[
        bool,
        live(
            "The principal may put one request in a class of a lower priority with the "
            "x-iop-priority-class header (never a higher one: that gets 403 "
            "priority_class_not_allowed). false: any such header gets 403."
        ),
    ] = True

    @property
    def list_key(self) -> str:
        return self.principal_ref


class SaturationSettings(Spec):
    """When a model counts as saturated: a sheddable request that arrives then is refused with
    429 model_saturated instead of queued. A model is saturated when either bound is reached."""

    queue_depth: Annotated[
        int,
        live(
            "Requests (of any class) waiting for the model at this Edge from which it is "
            "saturated: a backlog, demand beyond what its providers serve now. Below it a "
            "sheddable request may wait (behind every higher class), so that a busy fleet "
            "stays full between arrivals.",
            ge=1,
        ),
    ] = 8
    server_waiting: Annotated[
        int | None,
        live(
            "Requests waiting in a model server's own queue (vLLM's num_requests_waiting, read "
            "by its Node) from which its provider is full for a sheddable request even with a "
            "free slot at the Edge; the model is saturated when every available candidate is "
            "so. null: the servers' queues do not count.",
            ge=1,
        ),
    ] = 1


class PrioritySection(Spec):
    """Priority classes: who goes first when a model's providers are all busy, who is shed, and
    how long each may wait (docs/edge.md, "Priority classes"). A config that names no class
    runs every request in the built-in class `default` (priority 0, no wait bound of its own)."""

    classes: Annotated[
        list[PriorityClass],
        live("The classes, keyed by name; 'default' may be redefined."),
    ] = Field(default_factory=list)
    default_class: Annotated[
        Name | None,
        live(
            "The class of a request whose principal has no entry in principals and whose model "
            "names no priority_class. null: the built-in class 'default' (priority 0, waits "
            "only as long as its providers' queue_timeout_ms), or the class named 'default' "
            "when classes defines one."
        ),
    ] = None
    principals: Annotated[
        list[PrincipalPriority],
        live(
            "principal_ref -> its class (and whether it may lower a request's class); a "
            "principal with no entry takes its model's priority_class, then default_class."
        ),
    ] = Field(default_factory=list)
    saturation: Annotated[
        SaturationSettings, live("When a model counts as saturated for a sheddable request.")
    ] = SaturationSettings()
