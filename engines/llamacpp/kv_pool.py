"""The policies of one KV cache shared by the sequences (kv_unified): which sequence gives way.

Shared, the cache bounds how many requests run at once, not the sequence count: a request starts
when its prompt fits beside the others, idle sequences' KV gives way first (to the host cache),
and when the running ones outgrow it the newest is paused and resumes when there is room, as vLLM
preempts. Each policy here is a function of a plain description of the pool (`PoolSeq`) that
returns its decision; the scheduler (engines/llamacpp/batch.py) carries the decisions out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

# Tokens of prefix that make copying another sequence's KV stream worth it: the copy moves the
# whole stream (a few MB for a small model), prefill of 16 tokens costs more on any backend.
MIN_COPY_GAIN = 16

# Seconds a sequence stays idle before the trim may move its KV out of a shared cache. A
# conversation whose next turn comes sooner (an agent's tool call, a quick follow-up) finds its KV
# in place: on the H100 (Llama-3-8B-shaped, 4 agent sessions) the trim moved out two sessions
# 0.3 s before their next turns, each save stopping the last running stream for ~50 ms and each
# restore ~40 ms of the next turn's queue, to spare a few decode steps 0.3 ms each. After it, the
# trim also waits until the idle KV has cost the running passes TRIM_PAYBACK times what its copies
# would (`trim_paid`).
IDLE_TRIM_S = 1.0

# What idle KV must have cost the running passes, as a multiple of its copies' time, before the
# trim moves it out (1: a ski rental's break-even for the machine's time; 0: as soon as
# IDLE_TRIM_S has passed). More than 1 because the copies fall on one request's time to its first
# token and stop every stream at once, while the masked cells cost each pass a little: on the H200
# (Llama-3-8B-shaped, 4 agent sessions) at 1 the sessions that finished their first turn first
# were moved out during the others' prefills (charged ~300 ms each, copies ~120 ms) and restored
# for their next turn, whose TTFT p95 went from 13.2 % to 18.2 % of a cold prefill (the first
# turns within 3 % either way). At 8 such sessions stay, and a short conversation's KV (a few MiB,
# copies ~1 ms) still leaves after ~a second of others' decode steps.
TRIM_PAYBACK = 8.0

# What the trim learns of an idle sequence when it comes to it: whether its KV may leave the
# device (nothing of it is lost, or the host cache has room for it), and the seconds its copies
# out and back would take (None: not priced yet).
Price = Callable[[int], tuple[bool, float | None]]


@dataclass(frozen=True, slots=True)
class PoolSeq:
    """One sequence of the shared cache, as the policies see it."""

    seq_id: int
    cells: int  # cells its KV holds
    running: bool = False  # a request runs on it (else it is idle)
    idle_since: float = 0.0  # idle: when its last request left (perf_counter seconds)
    idle_cost: float = 0.0  # idle: seconds its cells have cost the running passes so far
    submitted: float = 0.0  # running: when its request was submitted
    decoding: bool = False  # running: it has a sampled token to decode in the next step
    unfed: int = 0  # running, not decoding: prompt tokens it has yet to prefill


def has_room(capacity: int, used: int, need: int) -> bool:
    """Whether `need` cells are free in a cache of `capacity` cells of which `used` are held."""
    return capacity - used >= need


def idle_oldest_first(seqs: Sequence[PoolSeq], keep: int | None = None) -> list[PoolSeq]:
    """Idle sequences holding KV (but `keep`), idle longest first."""
    return sorted((s for s in seqs if not s.running and s.cells and s.seq_id != keep), key=lambda s: s.idle_since)


def evictions(seqs: Sequence[PoolSeq], capacity: int, need: int, keep: int | None = None) -> tuple[list[int], bool]:
    """Idle sequences whose KV leaves, least recently used first (but `keep`), until `need` cells
    are free; and whether they are then."""
    used = sum(s.cells for s in seqs)
    out: list[int] = []
    for s in idle_oldest_first(seqs, keep):
        if has_room(capacity, used, need):
            break
        out.append(s.seq_id)
        used -= s.cells
    return out, has_room(capacity, used, need)


def start_need(unfed: int, prompt: int, held: int, n_batch: int) -> int:
    """Cells a request needs free to start: its prompt (less the `held` tokens its sequence holds
    of it) beside what the running requests have yet to prefill, and a batch more, so that a
    request just started is not paused by the next step."""
    return unfed + prompt - held + n_batch


def step_need(n_batch: int, decoding: int, unfed: int) -> int:
    """Cells the next step's tokens take: the decoding sequences' (`decoding` tokens, drafts
    included) and prompt chunks, at most a batch."""
    return min(n_batch, decoding + unfed)


def fit_step(seqs: Sequence[PoolSeq], capacity: int, n_batch: int, per_decode: int) -> tuple[list[int], list[int]]:
    """Make room for the next step: (idle sequences whose KV leaves, oldest first; running
    requests paused, newest first, until the step fits). Each decoding sequence takes
    `per_decode` tokens (1, or 1 plus a draft). A request alone is never paused."""
    running = [s for s in seqs if s.running]
    idle = idle_oldest_first(seqs)
    used = sum(s.cells for s in seqs)
    evict: list[int] = []
    pause: list[int] = []
    while True:
        need = step_need(n_batch, sum(per_decode for s in running if s.decoding), sum(s.unfed for s in running))
        while idle and not has_room(capacity, used, need):
            s = idle.pop(0)
            evict.append(s.seq_id)
            used -= s.cells
        if has_room(capacity, used, need) or len(running) <= 1:
            return evict, pause
        newest = max(range(len(running)), key=lambda i: running[i].submitted)
        victim = running.pop(newest)
        pause.append(victim.seq_id)
        used -= victim.cells


def trim_wanted(idle_cells: int, running_cells: int) -> bool:
    """Whether idle KV exceeds what the running requests hold and have yet to prefill. llama.cpp
    attends over every used cell of a shared cache, masked or not, so each running token also
    pays for the idle cells: the trim bounds that to about its own attention."""
    return idle_cells > running_cells


def trim_paid(idle_cost: float, copy_seconds: float | None, payback: float) -> bool:
    """Whether an idle sequence's cells have cost the running passes `payback` times what moving
    them out and back would, as a ski rental (not priced yet: the grace alone decides)."""
    return copy_seconds is None or idle_cost >= payback * copy_seconds


def trim(seqs: Sequence[PoolSeq], now: float, grace: float, payback: float, price: Price) -> Iterator[int]:
    """Idle sequences whose KV leaves the shared cache, least recently used first, while idle KV
    exceeds the running requests' (`trim_wanted`): those idle for `grace` seconds whose KV may
    leave and has cost the passes enough (`trim_paid`). `price` is asked of each in turn once the
    one before has left (a state saved to the host cache changes what fits there)."""
    if not any(s.running for s in seqs):
        return
    running = sum(s.cells + s.unfed for s in seqs if s.running)
    idle = idle_oldest_first(seqs)
    held = sum(s.cells for s in idle)
    recent = now - grace
    for s in idle:
        if not trim_wanted(held, running) or s.idle_since > recent:
            break  # oldest first: the rest were idle for less than `grace` too
        movable, copy_seconds = price(s.seq_id)
        if not movable or not trim_paid(s.idle_cost, copy_seconds, payback):
            continue
        held -= s.cells
        yield s.seq_id


def free_slot_by_prefix(cells: Sequence[int], held: Sequence[int]) -> int | None:
    """Which free sequence (by index) a prompt takes in a shared cache, where a sequence id costs
    nothing and the cells do: one whose KV starts the prompt but for a few tokens (nothing of it
    is lost), else an empty one (a prefix another sequence holds is copied in by sharing its
    cells), else one holding at least half its KV of the prompt (the conversation's own, whose last
    answer was tokenized differently: only that tail goes); None: the least missed
    (`least_missed`). `cells[i]`: the tokens free sequence i holds, `held[i]`: of them, the prompt's."""
    best = max(range(len(cells)), key=held.__getitem__)
    mine = held[best] >= MIN_COPY_GAIN
    if mine and held[best] + MIN_COPY_GAIN >= cells[best]:
        return best
    empty = [i for i, n in enumerate(cells) if not n]
    if empty:
        return empty[0]
    if mine and 2 * held[best] >= cells[best]:
        return best
    return None


def least_missed(cells: Sequence[int], covered: Sequence[int], idle_since: Sequence[float]) -> int:
    """The free sequence (by index) whose KV is least missed: the most of it held elsewhere
    (`covered`: a conversation whose next turn took another sequence and shares these cells),
    else idle longest. On the H100 a next turn took the idle-longest sequence, another session's
    only copy, over a stale one whose session now ran elsewhere: a 58 ms save and a 44 ms restore
    in that session's queue."""
    return min(range(len(cells)), key=lambda i: (cells[i] - covered[i], idle_since[i]))
