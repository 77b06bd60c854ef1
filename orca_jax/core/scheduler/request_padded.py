"""The "request_padded" policy: FasterTransformer as Orca measured it, "request"'s static batches
run as a rectangle. A batch is admitted only while members x longest prompt fits the token
budget, and prefills in one step; each step computes every member's row padded to the step's
longest, finished members included, until the last member ends. The padding is real work:
`ScheduledBatch.num_padding_tokens`, which the step's token bucket holds. A prompt longer than
the budget is admitted alone and prefills in chunks. No drafts are verified."""

from __future__ import annotations

from orca_jax.core.scheduler.base import SchedulerBase
from orca_jax.core.scheduler.request import admit_static_batch
from orca_jax.core.scheduler.scheduled_batch import ScheduledBatch
from orca_jax.core.sequence import Sequence


def schedule_padded_batch(s: SchedulerBase) -> ScheduledBatch:
    """Each step computes `width` tokens for every member, `width` the step's longest row (the
    longest prompt in the prefill step, 1 in a decode step); what a member's row lacks of it, and
    the whole row of a member that is done while the batch runs, is padding the step really
    computes. Drafts are dropped unverified: FasterTransformer did not speculate."""
    if not s.running:
        admit_static_batch(s, padded_prefill_fits)
    members = s.schedulable_running()
    rows = len(members) + done_members(s)
    # Admission keeps members x longest prompt within the budget, so only a lone member
    # longer than the budget (a long prompt, or one recomputed with its outputs after a lost
    # cache) prefills in chunks.
    width = min(max((seq.num_uncomputed_tokens for seq in members), default=0),
                s.config.max_num_batched_tokens // max(rows, 1))
    scheduled = ScheduledBatch()
    for seq in members:
        seq.draft_token_ids = []
        s.grant(scheduled, seq, min(seq.num_uncomputed_tokens, width))
    scheduled.num_padding_tokens = rows * width - scheduled.num_tokens
    return scheduled


def padded_prefill_fits(s: SchedulerBase, seq: Sequence, longest: int) -> bool:
    """Whether `seq` may join the static batch being admitted: the whole batch prefills in one
    step, every member padded to the longest prompt, so members x longest must fit
    max_num_batched_tokens. A first member longer than that is admitted alone and prefills in
    chunks of the budget (it has no one to be padded to): refusing it would leave it waiting for
    ever, and FasterTransformer had no token budget to pass."""
    if not s.running:
        return True
    width = max(longest, seq.num_uncomputed_tokens)
    return (len(s.running) + 1) * width <= s.config.max_num_batched_tokens


def done_members(s: SchedulerBase) -> int:
    """Members of the running static batch with nothing left to compute whose slots
    FasterTransformer still computes until the batch ends: those retired (finished or aborted)
    and those whose last token is in flight."""
    retired = s.static_batch_size - len(s.running)
    ending = sum(seq.num_tokens + seq.num_pending >= s.max_len(seq) for seq in s.running)
    return retired + ending
