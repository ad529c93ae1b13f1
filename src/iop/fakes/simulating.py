"""A simulated GPU model server: the timings of continuous batching with a prefix cache.

`GpuEngine` models what decides an LLM fleet's latency, the way vLLM's scheduler works, and
nothing else: tokens estimated from text (`BYTES_PER_TOKEN`), chats rendered by one template
(`render_chat`), a KV cache of hashed prefix blocks evicted least recently used, a batch of at
most `max_batch` admitted first come first served, and engine steps of chunked prefill and
decoding whose duration grows with the batch. It is pure state: `step()` is a function of what
was submitted and the seed, so tests drive it with no clock; `upstream.py` runs it in real time
and serves vLLM's metric names (`metrics_text`). docs/architecture.md, "The fakes", has the model.
"""

from __future__ import annotations

import hashlib
import random
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
    seed: int = 0

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
        if problems:
            raise ValueError("; ".join(problems))


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

    def submit(self, prompt: bytes, output_tokens: int, answer: bytes = b"") -> SimRequest:
        """Queue a request of `prompt` that generates `output_tokens` (its text: `answer`)."""
        self._ids += 1
        request = SimRequest(self._ids, prompt, answer, max(1, output_tokens))
        request.prompt_tokens = token_count(prompt)
        request.chain = self._chain(prompt)
        self._waiting.append(request)
        return request

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
        self._admit()
        if not self._running:
            return None
        settings = self.settings
        budget = settings.max_step_tokens
        tokens: list[tuple[SimRequest, int]] = []
        decoding = [r for r in self._running if r.prefill_left == 0]
        budget -= len(decoding)
        prefill = 0
        for request in self._running:
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
        return Step(duration, tuple(tokens), tuple(finished), prefill, running)

    def _admit(self) -> None:
        settings = self.settings
        while self._waiting and len(self._running) < settings.max_batch:
            request = self._waiting[0]
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
                    return  # first come, first served: it waits for room, and so do the rest
            self._waiting.popleft()
            for block in request.chain[:hits]:
                self._hold(block)
                request.held.append(block)
            self._evict(own)
            self._private += own
            request.private_blocks = own
            request.cached_tokens = hits * settings.block_tokens
            request.prefill_left = max(1, request.prompt_tokens - request.cached_tokens)
            self.prefix_queries += request.prompt_tokens
            self.prefix_hits += request.cached_tokens
            self.prompt_tokens += request.prompt_tokens
            self._running.append(request)

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

    def metrics_text(self, model: str) -> bytes:
        """`/metrics` in Prometheus' text format, with vLLM's names and labels."""
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
        )
        for name, help_text, value in counters:
            metric(name, "counter", help_text, value())
        return ("\n".join(lines) + "\n").encode()


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
