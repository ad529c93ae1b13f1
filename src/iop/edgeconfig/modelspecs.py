"""`models`: the catalog clients see, each model's providers, generation policy, fallbacks and
how it chooses among its best free providers."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .fields import ModelId, Name, Spec, live


class GenerationPolicy(Spec):
    """Defaults and caps applied to every request for a model."""

    max_tokens: Annotated[
        int | None,
        live(
            "Cap on completion tokens; a request asking for more is capped, a request naming "
            "none gets this many. Null means no cap.",
            ge=1,
        ),
    ] = None
    temperature: Annotated[
        float | None,
        live("Sampling temperature used when a request names none.", ge=0, le=2),
    ] = None
    top_p: Annotated[
        float | None, live("Nucleus sampling used when a request names none.", gt=0, le=1)
    ] = None


#: How a model picks among its best free providers (docs/edge.md, "Choosing among equals").
DispatchPolicyName = Literal["round_robin", "least_load", "prefix_affinity"]


class DispatchSettings(Spec):
    """How a model chooses among its best candidates: the providers of the lowest priority that
    have a free slot. Filtering, priority, capacity and long slots are the same under every
    policy; only the choice among those equals changes."""

    policy: Annotated[
        DispatchPolicyName,
        live(
            "round_robin: equals take turns (the least recently chosen goes next). least_load: "
            "the one with the lowest load for its capacity (this Edge's runs on it, plus its "
            "Node's runs from other Edges, plus the model server's requests from other clients "
            "when its /metrics tells them; KV-cache use breaks ties). prefix_affinity: a "
            "conversation "
            "goes back to the provider that holds its prompt's prefix (a hash of the prompt's "
            "leading blocks, the same on every Edge replica) while that provider's load stays "
            "within load_factor of its share and the prompt bytes waiting for prefill there "
            "(this Edge's runs before their first event), with the request's own new ones, are "
            "no more than the whole prompt on another free provider; otherwise the free "
            "provider with the least prefill waiting, then the least loaded, takes the request "
            "and becomes the prefix's new home."
        ),
    ] = "round_robin"
    load_factor: Annotated[
        float,
        live(
            "prefix_affinity's bound: a prefix's home keeps it while its load with the request "
            "stays at most this factor times its fair share (by capacity) of the load of the "
            "model's best candidates, rounded up (consistent hashing with bounded loads). "
            "Lower spreads load sooner, higher keeps more prefix-cache hits.",
            ge=1,
            le=10,
        ),
    ] = 1.25


class ModelSpec(Spec):
    """A model clients can ask for, and the providers that serve it."""

    id: Annotated[
        ModelId, live("The OpenAI `model` key clients send; also the provider pool's group key.")
    ]
    providers: Annotated[
        dict[Name, Annotated[str, Field(min_length=1)]],
        live(
            "Provider id -> the model name that provider actually serves; it must be one of "
            "that provider's served_models.",
            min_length=1,
        ),
    ]
    generation: Annotated[
        GenerationPolicy, live("Generation defaults and caps for this model.")
    ] = GenerationPolicy()
    fallbacks: Annotated[
        list[ModelId],
        live(
            "Models of this catalog that answer instead, in this order, when every provider of "
            "this model is unavailable or has failed before the first byte (each with its own "
            "fallbacks after it); retries after failures count against the retry budget. Ids "
            "must exist; no model may fall back to itself, directly or through others.",
            ordered=True,
        ),
    ] = Field(default_factory=list)
    first_byte_timeout_ms: Annotated[
        int | None,
        live(
            "Milliseconds a try of this model may take to the first byte for the client (a "
            "stream's first chunk, the whole answer of a request that does not stream), counted "
            "from when the run starts on its Node (not the queue wait). Past it the Edge cancels "
            "the run on its Node and, within `openai.retries`, tries another provider or a "
            "fallback; otherwise the client gets 504 `upstream_timeout`. Null: no limit but the "
            "adapter's request timeout (`request_timeout_s`, 600 s by default: the wait for "
            "the next byte, or a stream's next event with data).",
            ge=1,
        ),
    ] = None
    priority_class: Annotated[
        Name | None,
        live(
            "The priority class of this model's requests whose principal has no entry in "
            "openai.priority.principals (a name of openai.priority.classes); null: "
            "openai.priority.default_class."
        ),
    ] = None
    dispatch: Annotated[
        DispatchSettings,
        live(
            "How this model chooses among its best free providers: round_robin (the "
            "specification's rule), least_load or prefix_affinity (docs/edge.md)."
        ),
    ] = DispatchSettings()
    adapters: Annotated[
        list[ModelId],
        live(
            "LoRA adapters of this model that clients ask for by name: a request whose model is "
            "one of these runs on this model's providers, with the adapter's name as its model "
            "(the name the server serves it under: vLLM's --lora-modules NAME=PATH), on a "
            "server that has it loaded when one is free, else on one with room to load it, "
            "before one that must swap another adapter out; the capacity and priority rules "
            "stay the same (docs/edge.md, LoRA adapters). Each name is unique among the "
            "catalog's model ids and adapters; /v1/models lists an adapter with this model as "
            "its parent. Its requests take this model's generation policy, dispatch policy and "
            "priority class, and no fallbacks."
        ),
    ] = Field(default_factory=list)
