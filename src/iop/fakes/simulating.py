"""A simulated GPU model server: the timings of continuous batching with a prefix cache.

`GpuEngine` models what decides an LLM fleet's latency, the way vLLM's scheduler works, and
nothing else: tokens estimated from text (`BYTES_PER_TOKEN`), chats rendered by one template
(`render_chat`), a KV cache of hashed prefix blocks evicted least recently used, a batch of at
most `max_batch` admitted first come first served, engine steps of chunked prefill and decoding
whose duration grows with the batch, and LoRA adapters in `max_loras` slots (a load stalls the
step that needs it; a request whose adapter finds every slot busy waits for a swap). With
`scheduling_policy="priority"` (vLLM's `--scheduling-policy priority`) each request's `priority`
(lower first) orders the waiting queue and the prefill chunks, and a waiting request that finds
the batch or the cache full preempts the running request of the lowest priority below its own
(the latest admitted of those), which goes back to the queue and recomputes what it had. It is pure
state: `step()` is a function of what was submitted and the seed, so tests drive it with no
clock; the fake upstream runs it in real time (`upstream/gpuclock.py`) and serves vLLM's metric
names (`metrics_text`).
docs/architecture.md, "The fakes", has the model.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

#: Bytes of UTF-8 text a token, in the simulation (the Edge's own estimate: docs/edge.md).
BYTES_PER_TOKEN: Final = 4


def _flag(default: Any, help: str) -> Any:
    """A field that is also a flag of `iop fake-upstream`, `--gpu-<name>`, described by `help`."""
    return field(default=default, metadata={"flag_help": help})


@dataclass(frozen=True, slots=True)
class GpuSettings:
    """One simulated server's hardware and scheduler. Each field with a `flag_help` in its
    metadata is the fake upstream's flag `--gpu-<name>` (src/iop/cli/fake_upstream_commands.py
    derives the flags from these fields); `seed` comes from its `--seed`."""

    kv_tokens: int = _flag(65_536, "KV-cache size, in tokens")
    block_tokens: int = _flag(16, "tokens per KV-cache block (the prefix cache's unit)")
    max_batch: int = _flag(16, "most requests running")
    prefill_tokens_per_s: float = _flag(4_000.0, "prefill speed of the tokens not in the cache")
    step_ms: float = _flag(30.0, "a decode step of one request")
    step_ms_per_seq: float = _flag(1.5, "what each running request adds to a step")
    max_step_tokens: int = _flag(
        512, "tokens of work per step (decode tokens first, then prefill chunks)"
    )
    jitter: float = _flag(
        0.0, "each step lasts 1 +- this fraction longer, drawn from --seed (default 0)"
    )
    lora_adapters: str = _flag(
        "",
        "LoRA adapters served, comma-separated: a request whose model names one needs one of "
        "--gpu-max-loras adapter slots (default: none)",
    )
    max_loras: int = _flag(
        0, "LoRA adapters one batch may hold, each in a slot (vLLM's --max-loras; default 0)"
    )
    lora_load_ms: float = _flag(
        50.0, "what loading an adapter into a slot adds to the step that admits its request"
    )
    scheduling_policy: str = _flag(
        "fcfs",
        "fcfs, or priority: each request's priority (lower first) orders the queue and the "
        "prefill, and preempts a running request of a lower one (vLLM's --scheduling-policy); "
        "with fcfs a request with a nonzero priority gets 400, as from vLLM",
    )
    seed: int = 0

    @property
    def by_priority(self) -> bool:
        return self.scheduling_policy == "priority"

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters served (`lora_adapters`, split)."""
        return tuple(name.strip() for name in self.lora_adapters.split(",") if name.strip())

    def __post_init__(self) -> None:
        problems = []
        if self.block_tokens < 1:
            problems.append(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.kv_tokens < self.block_tokens:
            problems.append(f"kv_tokens must be >= block_tokens, got {self.kv_tokens}")
        if self.max_batch < 1:
            problems.append(f"max_batch must be >= 1, got {self.max_batch}")
        if self.prefill_tokens_per_s <= 0:
            problems.append(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        if self.step_ms <= 0 or self.step_ms_per_seq < 0:
            problems.append("step_ms must be > 0 and step_ms_per_seq >= 0")
        if self.max_step_tokens < self.max_batch:
            problems.append(f"max_step_tokens must be >= max_batch ({self.max_batch})")
        if not 0 <= self.jitter < 1:
            problems.append(f"jitter must be in [0, 1), got {self.jitter}")
        if self.max_loras < 0 or self.lora_load_ms < 0:
            problems.append("max_loras and lora_load_ms must be >= 0")
        if self.adapters and self.max_loras < 1:
            problems.append("lora_adapters need max_loras >= 1 (a slot to load one in)")
        if self.scheduling_policy not in ("fcfs", "priority"):
            problems.append(
                f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        if problems:
            raise ValueError("; ".join(problems))


def _by_priority(request: SimRequest) -> int:
    return request.priority


def token_count(text: bytes) -> int:
    """Tokens of `text` in the simulation: ceil(bytes / 4)."""
    return -(-len(text) // BYTES_PER_TOKEN)


def _part_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def render_chat(messages: Sequence[Any]) -> bytes:
    """A chat prompt as the simulated server's template renders it, ready for the answer."""
    out = []
    for message in messages:
        if isinstance(message, dict):
            out.append(f"<|{message.get('role', '')}|>\n{_part_text(message.get('content'))}")
            out.append("<|end|>\n")
    out.append("<|assistant|>\n")
    return "".join(out).encode()


def render_answer(text: str) -> bytes:
    """An answer as the template stores it: what the next turn's prompt repeats after it."""
    return f"{text}<|end|>\n".encode()


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request in the engine: its prompt's blocks and how far it got."""

    id: int
    prompt: bytes
    answer: bytes
    output_tokens: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_left: int = 0
    produced: int = 0
    #: Hashes of the prompt's full blocks, in order.
    chain: list[bytes] = field(default_factory=list)
    #: The cached blocks it holds a reference to (hits, then its own once computed).
    held: list[bytes] = field(default_factory=list)
    #: Blocks of its own it holds outside the prefix cache.
    private_blocks: int = 0
    done: bool = False
    cancelled: bool = False
    #: The LoRA adapter it runs with (None: the base model).
    adapter: str | None = None
    #: Its place in the queue with `scheduling_policy="priority"`: lower goes first.
    priority: int = 0
    #: Times it was preempted (and went back to the queue to recompute what it had).
    preempted: int = 0


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step: how long it takes, and what each request got at its end."""

    duration_s: float
    #: (request, tokens it got this step); a request's first entry is its first token.
    tokens: tuple[tuple[SimRequest, int], ...]
    #: The requests that finished at the end of this step.
    finished: tuple[SimRequest, ...]
    prefill_tokens: int
    running: int
    #: Adapters loaded into a slot for the requests admitted at this step (each paid for).
    adapter_loads: int = 0


class GpuEngine:
    """The simulated server's scheduler and KV cache; see the module docstring."""

    def __init__(self, settings: GpuSettings) -> None:
        self.settings = settings
        self._total_blocks = settings.kv_tokens // settings.block_tokens
        self._random = random.Random(settings.seed)
        #: Every cached block: hash -> references held by running requests.
        self._cached: dict[bytes, int] = {}
        #: Cached blocks nobody holds, least recently used first: what eviction takes.
        self._free: OrderedDict[bytes, None] = OrderedDict()
        self._private = 0
        self._waiting: deque[SimRequest] = deque()
        self._running: list[SimRequest] = []
        self._ids = 0
        # vLLM's counters.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = 0
        self.evictions = 0
        #: The LoRA adapters in the GPU's slots, least recently used first (at most max_loras).
        self._slots: OrderedDict[str, None] = OrderedDict()
        #: Adapters loaded into a slot, and those of them that took another's slot (swaps).
        self.adapter_loads = 0
        self.adapter_swaps = 0
        #: Running requests sent back to the queue for a waiting one of a higher priority.
        self.preemptions = 0

    # -- what the server sees -------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def kv_usage(self) -> float:
        """Share of the KV cache's blocks held by requests (cached free blocks are free)."""
        used = len(self._cached) - len(self._free) + self._private
        return used / self._total_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def loaded_adapters(self) -> tuple[str, ...]:
        """The adapters in the GPU's slots, least recently used first."""
        return tuple(self._slots)

    def running_adapters(self) -> tuple[str, ...]:
        """The adapters of the running requests, each once, in their order."""
        return tuple(dict.fromkeys(r.adapter for r in self._running if r.adapter is not None))

    def waiting_adapters(self) -> tuple[str, ...]:
        """The adapters of the waiting requests, each once, in their order."""
        return tuple(dict.fromkeys(r.adapter for r in self._waiting if r.adapter is not None))

    def submit(
        self,
        prompt: bytes,
        output_tokens: int,
        answer: bytes = b"",
        adapter: str | None = None,
        priority: int = 0,
    ) -> SimRequest:
        """Queue a request of `prompt` that generates `output_tokens` (its text: `answer`), with
        the LoRA adapter `adapter` (None: the base model) and `priority` (lower first; only
        with `scheduling_policy="priority"`, which else refuses any but 0)."""
        if adapter is not None and self.settings.max_loras < 1:
            raise ValueError(f"adapter {adapter!r} on a server without adapter slots")
        if priority and not self.settings.by_priority:
            raise ValueError(f"priority {priority} without priority scheduling")
        self._ids += 1
        request = SimRequest(
            self._ids, prompt, answer, max(1, output_tokens), adapter=adapter, priority=priority
        )
        request.prompt_tokens = token_count(prompt)
        request.chain = self._chain(prompt)
        self._queue(request)
        return request

    def _queue(self, request: SimRequest) -> None:
        """Into the waiting queue: at its end, or, by priority, in (priority, arrival) order, as
        vLLM's priority queue keeps it: a new request after every one of its priority or a
        higher (lower `priority`), a preempted one back in its place by arrival."""
        waiting = self._waiting
        key = (request.priority, request.id)
        if (
            not self.settings.by_priority
            or not waiting
            or ((waiting[-1].priority, waiting[-1].id) < key)
        ):
            waiting.append(request)
            return
        at = next(i for i, queued in enumerate(waiting) if (queued.priority, queued.id) > key)
        waiting.insert(at, request)

    def cancel(self, request: SimRequest) -> None:
        """The client left: the request stops and frees what it held."""
        if request.done:
            return
        request.cancelled = True
        if request in self._running:
            self._running.remove(request)
            self._release(request, cache_answer=False)
        else:
            self._waiting.remove(request)
        request.done = True

    # -- the scheduler ---------------------------------------------------------------------------

    def step(self) -> Step | None:
        """Run one engine step; None when there is nothing to do."""
        loads = self._admit()
        if not self._running:
            return None
        settings = self.settings
        budget = settings.max_step_tokens
        tokens: list[tuple[SimRequest, int]] = []
        decoding = [r for r in self._running if r.prefill_left == 0]
        budget -= len(decoding)
        prefill = 0
        prefilling = self._running
        if settings.by_priority:  # a stable sort: by arrival within one priority
            prefilling = sorted(prefilling, key=_by_priority)
        for request in prefilling:
            if request.prefill_left == 0 or budget <= 0:
                continue
            chunk = min(request.prefill_left, budget)
            request.prefill_left -= chunk
            budget -= chunk
            prefill += chunk
            if request.prefill_left == 0:
                self._computed(request)
                tokens.append((request, 1))
        for request in decoding:
            tokens.append((request, 1))
        duration = (
            settings.step_ms + settings.step_ms_per_seq * len(self._running)
        ) / 1000 + prefill / settings.prefill_tokens_per_s
        # Loading an adapter stalls the whole step, as vLLM's model runner loads it in line.
        duration += loads * settings.lora_load_ms / 1000
        if settings.jitter:
            duration *= 1 + settings.jitter * (2 * self._random.random() - 1)
        finished = []
        for request, count in tokens:
            request.produced += count
            self.generation_tokens += count
            if request.produced >= request.output_tokens:
                finished.append(request)
        running = len(self._running)
        for request in finished:
            self._running.remove(request)
            self._release(request, cache_answer=True)
            request.done = True
            self.finished += 1
        return Step(duration, tuple(tokens), tuple(finished), prefill, running, loads)

    def _admit(self) -> int:
        """Admit waiting requests while the batch and the cache have room; the adapters loaded
        for them. A request whose adapter is not among the running requests' while those fill
        every slot is skipped (it waits for a swap) and the next is looked at, as vLLM's
        scheduler does; one that the cache has no room for stops admission (first come, first
        served)."""
        settings = self.settings
        loads = 0
        skipped: list[SimRequest] = []
        try:
            while self._waiting:
                request = self._waiting[0]
                if len(self._running) >= settings.max_batch:
                    if not self._preempt_for(request):
                        break
                    continue
                if request.adapter is not None:
                    active = {r.adapter for r in self._running if r.adapter is not None}
                    if request.adapter not in active and len(active) >= settings.max_loras:
                        skipped.append(self._waiting.popleft())
                        continue
                if not self._admit_one(request):
                    if not self._preempt_for(request):
                        break
                    continue
                if request.adapter is not None:
                    loads += self._load(request.adapter)
        finally:
            self._waiting.extendleft(reversed(skipped))
        return loads

    def _preempt_for(self, request: SimRequest) -> bool:
        """With priority scheduling: send the running request of the lowest priority below
        `request`'s (the latest admitted of those) back to the queue, its blocks freed, to
        recompute its prompt and what it generated when admitted again (vLLM's recompute
        preemption); False when none is below it."""
        if not self.settings.by_priority:
            return False
        victim = max(reversed(self._running), key=_by_priority, default=None)
        if victim is None or victim.priority <= request.priority:
            return False
        self._running.remove(victim)
        self._release(victim, cache_answer=False)
        victim.preempted += 1
        self.preemptions += 1
        self._queue(victim)
        return True

    def _load(self, adapter: str) -> int:
        """Put `adapter` in a slot (1: it was not in one), evicting the least recently used
        adapter that no running request holds when every slot is taken."""
        slots = self._slots
        if adapter in slots:
            slots.move_to_end(adapter)
            return 0
        if len(slots) >= self.settings.max_loras:
            active = {r.adapter for r in self._running}
            victim = next(name for name in slots if name not in active)
            del slots[victim]
            self.adapter_swaps += 1
        slots[adapter] = None
        self.adapter_loads += 1
        return 1

    def _admit_one(self, request: SimRequest) -> bool:
        """Admit the waiting queue's head when the cache has room for it (False: it waits)."""
        settings = self.settings
        hits = 0
        for block in request.chain:
            if block not in self._cached:
                break
            hits += 1
        needed = -(-(request.prompt_tokens + request.output_tokens) // settings.block_tokens)
        own = needed - hits
        if own > self._room(request.chain[:hits]):
            if not self._running and own > self._total_blocks:
                own = self._total_blocks  # never fits: run it in what there is, not never
            else:
                return False  # first come, first served: it waits for room, and the rest
        self._waiting.popleft()
        for block in request.chain[:hits]:
            self._hold(block)
            request.held.append(block)
        self._evict(own)
        self._private += own
        request.private_blocks = own
        request.cached_tokens = hits * settings.block_tokens
        # A preempted request recomputes its prompt and the tokens it had generated.
        request.prefill_left = max(1, request.prompt_tokens - request.cached_tokens)
        request.prefill_left += request.produced
        if not request.preempted:
            self.prefix_queries += request.prompt_tokens
            self.prefix_hits += request.cached_tokens
            self.prompt_tokens += request.prompt_tokens
        self._running.append(request)
        return True

    def _room(self, hits: Sequence[bytes]) -> int:
        """Blocks a request could take now, after holding its `hits` (free cached ones evicted)."""
        held = len(self._cached) - len(self._free) + self._private
        reclaimed = sum(1 for block in hits if block in self._free)
        return self._total_blocks - held - reclaimed

    def _hold(self, block: bytes) -> None:
        self._cached[block] = self._cached.get(block, 0) + 1
        self._free.pop(block, None)

    def _evict(self, blocks: int) -> None:
        """Make room for `blocks` new ones: the least recently used free cached blocks go."""
        while self._free and len(self._cached) + self._private + blocks > self._total_blocks:
            block, _ = self._free.popitem(last=False)
            del self._cached[block]
            self.evictions += 1

    def _computed(self, request: SimRequest) -> None:
        """The prompt is computed: its own full blocks join the prefix cache."""
        for block in request.chain[len(request.held) :]:
            if request.private_blocks:
                request.private_blocks -= 1
                self._private -= 1
            self._hold(block)
            request.held.append(block)

    def _release(self, request: SimRequest, *, cache_answer: bool) -> None:
        self._private -= request.private_blocks
        request.private_blocks = 0
        extra: list[bytes] = []
        if cache_answer and request.answer:
            # The answer's full blocks stay cached too, as vLLM keeps generated tokens' blocks:
            # the conversation's next turn begins with them.
            chain = self._chain(request.prompt + request.answer)
            extra = [block for block in chain[len(request.chain) :] if block not in self._cached]
        for block in request.held:
            references = self._cached[block] - 1
            self._cached[block] = references
            if references == 0:
                self._free[block] = None
                self._free.move_to_end(block)
        request.held.clear()
        for block in extra:
            self._evict(1)
            if len(self._cached) + self._private >= self._total_blocks:
                break
            self._cached[block] = 0
            self._free[block] = None

    def _chain(self, text: bytes) -> list[bytes]:
        size = self.settings.block_tokens * BYTES_PER_TOKEN
        chain: list[bytes] = []
        previous = b""
        for start in range(0, len(text) - size + 1, size):
            previous = hashlib.blake2b(
                previous + text[start : start + size], digest_size=8
            ).digest()
            chain.append(previous)
        return chain

    # -- vLLM's metrics ------------------------------------------------------------------------

    def metrics_text(self, model: str, now: float | None = None) -> bytes:
        """`/metrics` in Prometheus' text format, with vLLM's names and labels; `now`: the
        Unix time `vllm:lora_requests_info` is stamped with (default: the clock's)."""
        labels = f'{{engine="0",model_name="{_label(model)}"}}'
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name}{labels} {value}")

        metric(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            self.running,
        )
        metric(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            self.waiting,
        )
        metric(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            round(self.kv_usage, 6),
        )
        counters: Sequence[tuple[str, str, Callable[[], int]]] = (
            (
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
                lambda: self.prefix_queries,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
                lambda: self.prefix_hits,
            ),
            (
                "vllm:prompt_tokens_total",
                "Number of prefill tokens processed.",
                lambda: self.prompt_tokens,
            ),
            (
                "vllm:generation_tokens_total",
                "Number of generation tokens processed.",
                lambda: self.generation_tokens,
            ),
            (
                "vllm:request_success_total",
                "Count of successfully processed requests.",
                lambda: self.finished,
            ),
            (
                "vllm:num_preemptions_total",
                "Cumulative number of preemption from the engine.",
                lambda: self.preemptions,
            ),
        )
        for name, help_text, value in counters:
            metric(name, "counter", help_text, value())
        if self.settings.max_loras:
            # vLLM's one LoRA metric: the adapters of the running and the waiting requests as
            # labels, the time it was set as its value.
            running = _label(",".join(self.running_adapters()))
            waiting = _label(",".join(self.waiting_adapters()))
            lines.append("# HELP vllm:lora_requests_info Running stats on lora requests.")
            lines.append("# TYPE vllm:lora_requests_info gauge")
            lines.append(
                f'vllm:lora_requests_info{{max_lora="{self.settings.max_loras}",'
                f'running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"}} '
                f"{time.time() if now is None else now}"
            )
        return ("\n".join(lines) + "\n").encode()


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
