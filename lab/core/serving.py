"""Serving under load: requests, a paged KV pool and the continuous-batching scheduler, shared by the executed engine
(:mod:`lab.run.serve`) and the simulator (:mod:`lab.predict.inference.serve`).

The scheduler follows what vLLM's (V1) and Sarathi-Serve's do, reduced to the decisions that set latency:

* **Paged KV cache.** The pool holds ``pages`` pages of ``page_size`` tokens; a sequence owns a list of pages (its
  page table) that grows a page at a time; a free list hands them out.
* **One token budget per step** (vLLM's ``max_num_batched_tokens``). Running sequences go first, in the order they
  were admitted: a decoding one takes one token, one still in its prompt takes the next chunk that fits the budget
  (chunked prefill, mixed with the decodes in one step). What is left of the budget admits waiting requests, first
  come first served, while a slot (``max_seqs``) and pages for the first chunk are free.
* **Preemption by recompute.** When a running sequence needs a page and none is free, the most recently admitted
  running sequence gives its pages back and returns to the head of the queue; when it is admitted again it prefills
  its prompt and the tokens it had generated (nothing is swapped out).

Every sequence is a count of *known* tokens (prompt plus generated) and *computed* ones (whose K and V are in the
cache). A step computes a chunk of a sequence's known tokens; a chunk that reaches the last known token samples the
next one. A decode is the chunk of one token. :func:`drive` runs a load through one scheduler per data-parallel
replica, stepping them together (one SPMD program), on whatever prices or executes a step.

Over 500 lines on purpose: the requests, the pool, the scheduler, its driver and the latency summary are one model
of a serving loop that the engine and the simulator must share exactly; split, each piece would import the others.
"""
# Over 500 lines on purpose: the requests, the page pool and the scheduler are one state machine that the engine and the
# simulator share exactly; its invariants (a page freed once, who is preempted first) would span modules if split.

from __future__ import annotations

import heapq
import json
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from lab.core.errors import UserError

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Request:
    rid: int
    arrival_s: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Lengths:
    """A length drawn per request: fixed (``lo == hi``) or uniform over ``[lo, hi]``; written 512 or 128-1024."""

    lo: int
    hi: int = 0  # 0: the same as lo

    def __post_init__(self) -> None:
        if not self.hi:
            object.__setattr__(self, "hi", self.lo)

    @classmethod
    def parse(cls, text: str | int, flag: str) -> Lengths:
        s = str(text).strip()
        lo_s, sep, hi_s = s.partition("-")
        try:
            lo, hi = int(lo_s), int(hi_s) if sep else int(lo_s)
        except ValueError:
            raise UserError(f"{flag} {text!r} is not a token count or a range LO-HI, e.g. 512 or 128-1024") from None
        if lo < 1 or hi < lo:
            raise UserError(f"{flag} {text!r} must be at least 1 (a range LO-HI with LO <= HI), e.g. 512 or 128-1024")
        return cls(lo, hi)

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2

    def draw(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"


def poisson_requests(n: int, rate: float, prompt: Lengths, output: Lengths, seed: int = 0) -> list[Request]:
    """``n`` requests arriving as a Poisson process of ``rate`` per second (all at once for an infinite rate)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UserError(f"--requests must be a positive integer, got {n!r}")
    if not rate > 0:  # also refuses nan
        raise UserError(f"--rate must be requests per second above 0 (or inf: all at once), got {rate!r}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(Request(i, t, prompt.draw(rng), output.draw(rng)))
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    return out


def load_trace(path: str | Path) -> list[Request]:
    """Requests from a JSON-lines file, one object a line: ``arrival_s``, ``prompt_len``, ``output_len``."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(
            f"--trace {str(path)!r} cannot be read ({exc.__class__.__name__}); give a JSON-lines file"
        ) from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            req = Request(len(out), float(row["arrival_s"]), int(row["prompt_len"]), int(row["output_len"]))
        except (ValueError, KeyError, TypeError):
            raise UserError(
                f'--trace {p.name} line {n} is not {{"arrival_s": 0.0, "prompt_len": 512, "output_len": 128}}'
            ) from None
        if not (math.isfinite(req.arrival_s) and req.arrival_s >= 0 and req.prompt_len >= 1 and req.output_len >= 1):
            raise UserError(f"--trace {p.name} line {n}: arrival_s must be >= 0 and both lengths >= 1, got {line}")
        out.append(req)
    if not out:
        raise UserError(f"--trace {p.name} holds no requests; one JSON object a line")
    return sorted(out, key=lambda r: r.arrival_s)


@dataclass(eq=False, slots=True)
class Seq:
    """A request inside the scheduler."""

    req: Request
    tokens: list[int] | None = None  # the executed engine's token ids (prompt, then generated); None when simulated
    known: int = 0
    computed: int = 0
    generated: int = 0
    pages: list[int] = field(default_factory=list)
    slot: int = -1
    first_token_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0


class Work(NamedTuple):
    """A sequence's share of one step: ``count`` tokens from position ``start``; ``samples`` when the chunk ends at
    the last known token (the step then samples the sequence's next token). A tuple: a simulated load makes one per
    sequence per step, millions for a large one."""

    seq: Seq
    start: int
    count: int
    samples: bool


@dataclass(frozen=True)
class Step:
    work: tuple[Work, ...]
    preempted: tuple[Seq, ...] = ()

    @property
    def tokens(self) -> int:
        return sum(w.count for w in self.work)


@dataclass(frozen=True)
class PoolConfig:
    pages: int
    page_size: int = 16  # vLLM's default block size
    max_seqs: int = 256  # vLLM's default max_num_seqs
    token_budget: int = 2048  # tokens per step (max_num_batched_tokens)

    def check(self) -> None:
        for name in ("pages", "page_size", "max_seqs", "token_budget"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    def check_fits(self, req: Request) -> None:
        need = req.prompt_len + req.output_len
        if need > self.tokens:
            raise UserError(
                f"the KV pool holds {self.tokens} tokens ({self.pages} pages of {self.page_size}), less than one "
                f"request's {req.prompt_len} + {req.output_len}; give more pages or shorter requests"
            )


class Scheduler:
    """One replica's continuous-batching scheduler over a paged pool (module docstring)."""

    def __init__(self, pool: PoolConfig):
        pool.check()
        self.pool = pool
        self.free_pages = list(range(pool.pages - 1, -1, -1))  # pop() hands out page 0 first
        self.free_slots = list(range(pool.max_seqs - 1, -1, -1))
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.preemptions = 0

    @property
    def used_fraction(self) -> float:
        return 1.0 - len(self.free_pages) / self.pool.pages

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, req: Request, tokens: list[int] | None = None) -> Seq:
        self.pool.check_fits(req)
        seq = Seq(req, tokens, known=req.prompt_len)
        self.waiting.append(seq)
        return seq

    def _grow(self, seq: Seq, upto: int) -> bool:
        """Give ``seq`` pages for ``upto`` tokens; False when the free list is short."""
        need = -(-upto // self.pool.page_size) - len(seq.pages)
        free = self.free_pages
        if need > len(free):
            return False
        if need > 0:  # from the end of the free list, the next page handed out first
            seq.pages.extend(reversed(free[-need:]))
            del free[-need:]
        return True

    def _release(self, seq: Seq) -> None:
        self.free_pages.extend(reversed(seq.pages))
        seq.pages = []
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1

    def _preempt(self, seq: Seq) -> None:
        self._release(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> Step:
        budget, work, preempted = self.pool.token_budget, [], []
        running, i, size = self.running, 0, self.pool.page_size
        add, new = work.append, tuple.__new__  # Work(...) through its class costs 2.5x this
        while i < len(running) and budget > 0:
            seq = running[i]
            start = seq.computed
            n = seq.known - start
            if n > budget:
                n = budget
            end = start + n
            # most steps decode into a page the sequence already has: no allocation to try
            while end > len(seq.pages) * size and not self._grow(seq, end):
                victim = running.pop()  # the most recently admitted: never one already in this step (index >= i)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                add(new(Work, (seq, start, n, end == seq.known)))
                budget -= n
                i += 1
        while self.waiting and budget > 0 and self.free_slots:
            seq = self.waiting[0]
            n = min(seq.known - seq.computed, budget)
            if not self._grow(seq, n):
                break
            self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            running.append(seq)
            work.append(Work(seq, 0, n, n == seq.known))
            budget -= n
        return Step(tuple(work), tuple(preempted))

    def steady_steps(self) -> int:
        """How many of the next steps are plain decodes of the running sequences, every one decided already: 0
        unless every running sequence decodes (each within the budget) and no waiting one can join; then the steps
        until the first of them finishes or the pool could not give the pages they grow into (nothing preempted)."""
        running, size = self.running, self.pool.page_size
        if not running or len(running) > self.pool.token_budget or not self._admission_blocked():
            return 0
        if any(s.known - s.computed != 1 or not s.generated for s in running):
            return 0
        k = min(s.req.output_len - s.generated for s in running)
        free = len(self.free_pages)

        def pages(j: int) -> int:  # new pages j decode steps take
            return sum(max(0, -(-(s.computed + j) // size) - len(s.pages)) for s in running)

        if pages(k) <= free:
            return k
        lo, hi = 0, k  # pages(lo) fits, pages(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if pages(mid) <= free else (lo, mid)
        return lo

    def _admission_blocked(self) -> bool:
        """No waiting request can join while the running ones only decode: none waits, or no slot, budget or page
        for its first chunk is left (decoding frees none of them until a sequence finishes)."""
        if not self.waiting:
            return True
        budget = self.pool.token_budget - len(self.running)
        if not self.free_slots or budget <= 0:
            return True
        head = self.waiting[0]
        return -(-min(head.known - head.computed, budget) // self.pool.page_size) > len(self.free_pages)

    def steady_shape(self) -> tuple[int, int, tuple[int, ...]]:
        """(decoding sequences, positions their next step reads, each sequence's): what prices a run of steady
        steps (the sum where every layer reads every position; each sequence's where a window caps some)."""
        each = tuple(s.known for s in self.running)
        return len(each), sum(each), each

    def advance(self, k: int, now: float) -> tuple[list[Seq], float]:
        """Apply ``k`` steady decode steps (see :meth:`steady_steps`) ending at ``now``: the finished sequences, and
        the pool's use after the step before the last (what a step-by-step trace records last before they leave)."""
        for seq in self.running:
            self._grow(seq, seq.computed + k - 1)
        before_last = self.used_fraction
        done = []
        for seq in self.running:
            seq.computed += k
            seq.known += k
            seq.generated += k
            self._grow(seq, seq.computed)
            if seq.generated >= seq.req.output_len:
                seq.finish_s = now
                done.append(seq)
        return self._retire(done), before_last

    def complete(self, step: Step, now: float, sampled: dict[int, int] | None = None) -> list[Seq]:
        """Record ``step`` as finished at ``now`` (``sampled``: the engine's new token per request id); the
        sequences that finished, their pages freed."""
        done = []
        for seq, start, count, samples in step.work:
            seq.computed = start + count
            if not samples:
                continue
            seq.known += 1
            seq.generated += 1
            if sampled is not None:
                seq.tokens.append(sampled[seq.req.rid])
            if seq.first_token_s is None:
                seq.first_token_s = now
            if seq.generated >= seq.req.output_len:
                seq.finish_s = now
                done.append(seq)
        return self._retire(done)

    def _retire(self, done: list[Seq]) -> list[Seq]:
        if done:
            finished = set(map(id, done))
            self.running = [s for s in self.running if id(s) not in finished]
            for seq in done:
                self._release(seq)
        return done


@dataclass
class Served:
    """What a load did: every request's sequence, and the pool's use after each step."""

    seqs: list[Seq]
    pool_trace: list[tuple[float, float]]  # (seconds, fraction of the pool in use, the fullest replica's)
    steps: int
    preemptions: int
    makespan_s: float
    step_times: list[float] = field(default_factory=list)  # each step's seconds, in order


StepRunner = Callable[[Sequence[Step]], tuple[float, dict[int, int] | None]]


def drive(
    requests: Sequence[Request],
    pool: PoolConfig,
    run: StepRunner,
    replicas: int = 1,
    concurrency: int | None = None,
    prompts: dict[int, list[int]] | None = None,
) -> Served:
    """Serve ``requests`` on ``replicas`` schedulers stepped together: ``run`` takes each replica's step and returns
    the step's seconds (priced or measured) and, when executing, the new token of each sampling request. A runner
    that prices (the simulator) may also have ``steady(shapes, k)``: the seconds of each of ``k`` decode-only steps
    from every replica's :meth:`Scheduler.steady_shape`, so that a stretch where no decision changes is priced
    without walking every sequence through every step.

    Open loop: each request joins at its ``arrival_s``, to the replica with the fewest sequences. Closed loop
    (``concurrency`` C): C clients each send their next request when their last one finishes, arrivals ignored."""
    for req in requests:
        pool.check_fits(req)
    scheds = [Scheduler(pool) for _ in range(replicas)]
    # requests not yet arrived, by arrival: all of them (open loop), or each client's next one (closed loop)
    later = deque(Request(r.rid, 0.0, r.prompt_len, r.output_len) for r in requests) if concurrency else deque()
    due = [(r.arrival_s, r.rid, r) for r in requests] if not concurrency else []
    for _ in range(min(concurrency or 0, len(later))):
        r = later.popleft()
        due.append((0.0, r.rid, r))
    heapq.heapify(due)
    seqs: list[Seq] = []
    trace: list[tuple[float, float]] = []
    now, steps, durations = 0.0, 0, []
    steady = getattr(run, "steady", None)

    def finished(done: list[Seq]) -> None:
        for _ in done:
            if later:  # that client's next request
                r = later.popleft()
                heapq.heappush(due, (now, r.rid, Request(r.rid, now, r.prompt_len, r.output_len)))

    while True:
        while due and due[0][0] <= now:  # to the replica with the fewest sequences
            req = heapq.heappop(due)[2]
            target = min(scheds, key=lambda s: len(s.running) + len(s.waiting))
            seqs.append(target.add(req, list(prompts[req.rid]) if prompts is not None else None))
        if not any(s.busy for s in scheds):  # idle: jump to the next arrival, or stop
            if not due:
                break
            now = max(now, due[0][0])
            continue
        k = min((s.steady_steps() for s in scheds if s.busy), default=0) if steady else 0
        if k > 1:  # a priced run of decode-only steps, taken at once (the same decisions, step by step)
            times = steady([s.steady_shape() for s in scheds], k)
            arrival = due[0][0] if due else math.inf
            j = 0
            while j < k:  # up to the step during which the next request arrives
                now += times[j]
                j += 1
                if now >= arrival:
                    break
            steps += j
            durations += times[:j]
            before = 0.0
            for sched in scheds:
                done, used = sched.advance(j, now)
                before = max(before, used)
                finished(done)
            trace.append((now - times[j - 1], before))
            trace.append((now, max(s.used_fraction for s in scheds)))
            continue
        plan = [s.schedule() for s in scheds]
        if not any(step.work for step in plan):  # cannot happen: a busy replica always has work (docstring)
            raise RuntimeError("the scheduler made no progress with requests waiting")
        seconds, sampled = run(plan)
        now += seconds
        steps += 1
        durations.append(seconds)
        for sched, step in zip(scheds, plan, strict=True):
            finished(sched.complete(step, now, sampled))
        trace.append((now, max(s.used_fraction for s in scheds)))
    return Served(seqs, trace, steps, sum(s.preemptions for s in scheds), now, durations)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 by linear interpolation between order statistics (numpy's default), and the mean (what serving
    benchmarks print beside them)."""
    xs = sorted(values)
    out: dict[str, float | None] = {"mean": sum(xs) / len(xs) if xs else None}
    for q in PERCENTILES:
        if not xs:
            out[f"p{q}"] = None
            continue
        pos = (len(xs) - 1) * q / 100
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{q}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


def summarize(served: Served) -> dict[str, object]:
    """Per-request latencies as serving benchmarks report them (vLLM's benchmark_serving): TTFT from arrival to the
    first token, TPOT the mean gap between the later tokens (requests of one output token have none), end-to-end
    latency, and output tokens per second over the whole run."""
    ttft, tpot, e2e = [], [], []
    for s in served.seqs:
        ttft.append(s.first_token_s - s.req.arrival_s)
        e2e.append(s.finish_s - s.req.arrival_s)
        if s.req.output_len > 1:
            tpot.append((s.finish_s - s.first_token_s) / (s.req.output_len - 1))
    out_tokens = sum(s.req.output_len for s in served.seqs)
    return {
        "requests": len(served.seqs),
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
        "e2e_s": percentiles(e2e),
        "throughput_tokens_per_s": out_tokens / served.makespan_s if served.makespan_s > 0 else None,
        "kv_pool_peak_fraction": max((f for _, f in served.pool_trace), default=0.0),
        "preemptions": served.preemptions,
        "steps": served.steps,
        "makespan_s": served.makespan_s,
    }


__all__ = [
    "PERCENTILES",
    "Lengths",
    "PoolConfig",
    "Request",
    "Scheduler",
    "Seq",
    "Served",
    "Step",
    "Work",
    "drive",
    "load_trace",
    "percentiles",
    "poisson_requests",
    "summarize",
]
