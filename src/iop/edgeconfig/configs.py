"""The EdgeConfig model: one pydantic schema for edge.yaml, the CRD spec and `kubectl explain`.

The root of the model; each section lives in a module of its own (`edgesections`,
`openaisections`, `limitsections`, `prioritysections`, `modelspecs`, `nodespecs`,
`rolloutsections`), and `fields` holds what they are made of: the apply markers, the value types
and the base `Spec`. The checks between sections live in `validating.py`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from .edgesections import A2ASection, ControlPlaneSection, EdgeSection
from .fields import Spec, live, restart_edge
from .modelspecs import ModelSpec
from .nodespecs import NodeSpec
from .openaisections import OpenAISection
from .rolloutsections import RolloutSection


class EdgeConfig(Spec):
    """The whole configuration of one Edge: its listeners, models, nodes and providers."""

    edge: Annotated[EdgeSection, restart_edge("The Edge's identity and listeners.")]
    control_plane: Annotated[ControlPlaneSection, restart_edge("Remote control plane.")] = (
        ControlPlaneSection()
    )
    openai: Annotated[OpenAISection, restart_edge("The OpenAI-compatible API.")] = OpenAISection()
    a2a: Annotated[A2ASection, restart_edge("The A2A listener.")] = A2ASection()
    rollout: Annotated[
        RolloutSection, live("How a live change is watched and rolled back (docs/rollout.md).")
    ] = RolloutSection()
    models: Annotated[list[ModelSpec], live("The model catalog clients see at /v1/models.")] = (
        Field(default_factory=list)
    )
    nodes: Annotated[
        list[NodeSpec],
        restart_edge(
            "The Node agents and their providers. This rule is for adding or removing a node; "
            "each field below carries its own (the nearest rule wins), and most of them, a "
            "provider's capacity or priority among them, are live."
        ),
    ] = Field(default_factory=list)
