"""Prefix sharing between sequences: a prompt that starts as another sequence's KV copies it
instead of prefilling it (the next chat turn, a common system prompt, `n` choices of one prompt).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import llama_cpp as lc

from engines.llamacpp.kv_pool import MIN_COPY_GAIN
from engines.llamacpp.slots import GenJob, Job, Slot, common_prefix

log = logging.getLogger(__name__)

# A prompt goes to the free sequence already holding its prefix (instead of the lowest free one)
# when that prefix is at least this long and at least half the prompt.
OWN_SLOT_TOKENS = 256

# Tokens of prefix a new prompt must share with a running request's prompt, beyond what any KV
# holds of it yet, to wait for that request's prefill and copy it rather than prefill it alongside
# (`leader_for`): `n` choices of one prompt, agents' sessions opened at once with one system prompt.
FOLLOW_MIN_TOKENS = 64


def own_slot(job: Job, free: list[Slot]) -> Slot:
    """The free sequence a request takes when each sequence has its own KV stream: the lowest,
    always (llama.cpp runs a step as one micro-batch, a pass over the weights, per run of
    consecutive sequence ids: docs/benchmarks/history.md#steps-laid-out-for-llamacpps-micro-batches-rejected;
    on the H100 after a 16-stream burst 8 streams fell from ~2000 to ~850 tok/s when new requests
    took the free slot with the longest cached prefix). A longer prefix
    held by another slot is still reused: it is copied into the chosen stream. The exception: a
    free slot that holds most of a long prompt (a conversation's own sequence, its next turn)
    keeps it, rather than evicting another conversation's KV to copy this one's over."""
    if isinstance(job, GenJob) and len(free) > 1 and len(job.prompt_ids) >= 2 * OWN_SLOT_TOKENS:
        held = [common_prefix(s.cached, job.prompt_ids) for s in free]
        best = max(range(len(free)), key=held.__getitem__)
        if held[best] >= OWN_SLOT_TOKENS and 2 * held[best] >= len(job.prompt_ids) and held[best] > held[0]:
            return free[best]
    return free[0]


def donor_for(slots: list[Slot], slot: Slot, prompt: list[int]) -> Slot | None:
    """The other sequence (running or finished) holding the longest prefix of `prompt`."""
    return max((s for s in slots if s is not slot), default=None, key=lambda s: common_prefix(s.cached, prompt))


def copy_prefix(mem: Any, donor: Slot, slot: Slot, n: int) -> None:
    """The donor's KV into the slot's sequence, standing for its first `n` tokens. Sequences
    live in separate KV streams; llama.cpp copies whole streams (at the next decode), and the
    caller cuts the copy back to `n` (`llama_memory_seq_rm` from `n` on)."""
    lc.llama_memory_seq_rm(mem, slot.seq_id, -1, -1)
    lc.llama_memory_seq_cp(mem, donor.seq_id, slot.seq_id, -1, -1)
    slot.cached = donor.cached[:n]


def leader_for(active: list[Slot], job: GenJob, keep: int) -> tuple[Slot, Job, int] | None:
    """A running request whose prompt starts as this one's for at least FOLLOW_MIN_TOKENS more
    than `keep` (what this sequence holds now) and whose prefill has not fed that far yet: this
    request waits for it and copies its KV (`take_followed`) instead of computing the same prefix
    alongside it, sharing the step's prompt budget. A request that itself waits leads no other
    (each waits for the one computing)."""
    limit = len(job.prompt_ids) - 1  # at least one prompt token is decoded here, for logits
    best: tuple[Slot, Job, int] | None = None
    for s in active:
        if not isinstance(s.job, GenJob) or s.follow is not None:
            continue
        shared = min(common_prefix(s.job.prompt_ids, job.prompt_ids), limit)
        if shared > s.n_fed and shared >= keep + FOLLOW_MIN_TOKENS and (best is None or shared > best[2]):
            best = (s, s.job, shared)
    return best


def take_followed(mem: Any, slot: Slot, usable: Callable[[Slot, int], int]) -> int | None:
    """For a slot waiting on its leader (`leader_for`): None while it must still wait; else the
    prompt tokens copied from the leader (0: none, the slot prefills them). Once the leader's KV
    holds the shared prefix (fed in an earlier step) it is copied in; when the leader is gone
    (finished, failed, cancelled, paused), whatever its sequence still holds of the prefix is."""
    assert slot.follow is not None and isinstance(slot.job, GenJob)
    leader, led, n = slot.follow
    if leader.job is led and leader.n_fed < n:
        return None
    slot.follow = None
    job = slot.job
    have = usable(leader, min(common_prefix(leader.cached, job.prompt_ids), n))
    if have < slot.n_fed + MIN_COPY_GAIN:
        return 0
    copy_prefix(mem, leader, slot, have)
    lc.llama_memory_seq_rm(mem, slot.seq_id, have, -1)
    slot.n_fed = have
    slot.n_cached_prompt = min(have, len(job.prompt_ids) - job.resumed)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("sequence %d copied %d prompt tokens from sequence %d's prefill", slot.seq_id, have, leader.seq_id)
    return have
