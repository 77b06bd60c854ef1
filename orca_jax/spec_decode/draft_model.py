"""DraftModelProposer: drafts from a small model of the same tokenizer, run by the engine's own
machinery: a second `ModelRunner` with its own weights, paged KV cache, persistent batch state
and compiled token buckets.

Each target sequence that speculates has a shadow `Sequence` on the draft side: the same
prompt and output lists (shared, so it sees every token the target appends), its own pages,
slot and cached count. Proposing for a set of sequences is

    catch-up   one or more draft steps over each shadow's tokens it has not computed (the
               whole prompt the first time, then the tokens the last verification accepted),
               chunked to the token budget; the row that reaches a sequence's end samples d1
    chain      k - 1 steps of one token per sequence, each fed from the device (the token the
               step before sampled), sampling d2 .. dk

all dispatched back to back and read once at the end. Drafts are greedy (the draft model's
argmax), so the proposal is a point mass and the target's acceptance rule
(orca_jax.worker.rejection) keeps the target's distribution exactly.

After a verification the shadow's cache is valid up to the longest prefix of the drafts it fed
that the target kept; the next proposal compares them and computes from there. Shadows of
sequences no longer running give their pages and slot back. A shadow that cannot get pages
proposes nothing (its target decodes plainly); speculation never preempts.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from orca_jax.config import EngineConfig
from orca_jax.core.kv_cache import PageAllocator
from orca_jax.loading.loader import load_model
from orca_jax.worker.runner import ModelRunner
from orca_jax.worker.runner_base import WarmupReport
from orca_jax.core.sampling_params import SamplingParams
from orca_jax.core.scheduler import ScheduledBatch, SlotAllocator
from orca_jax.core.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclasses.dataclass(eq=False)
class _Shadow:
    seq: Sequence  # the draft side's sequence: the target's token lists, its own pages and slot
    target: Sequence
    fed_from: int = 0  # position of the first draft token the last chain fed
    fed_drafts: tuple[int, ...] = ()  # drafts the last chain fed (their K/V are in the draft cache)


class DraftModelProposer:
    def __init__(self, target_config: EngineConfig, model: str | None, attention_impl: str, num_pages: int,
                 mesh=None):
        """`mesh`: a data-parallel replica's one-device mesh, so the draft runs beside its
        target (None: the default device)."""
        if target_config.tensor_parallel_size > 1 or (jax.process_count() > 1 and mesh is None):
            raise ValueError("speculative_config method 'draft_model' runs on one device of one process: "
                             "tensor_parallel_size must be 1 and jax.distributed not started")
        loaded = load_model(model or target_config.model, dtype=target_config.dtype,
                            cache_dir=target_config.model_cache_dir)
        self.model_config = loaded.config
        if loaded.config.max_position_embeddings < target_config.max_model_len:
            raise ValueError(f"draft model context {loaded.config.max_position_embeddings} is shorter than "
                             f"max_model_len {target_config.max_model_len}")
        # The draft side runs the target's shapes (buckets, slots, context) in its own pool of
        # as many pages, without prefix caching or speculation of its own.
        config = dataclasses.replace(
            target_config, model=model or target_config.model, speculative_config=None, enable_prefix_caching=False,
            scheduling="iteration", num_pages=num_pages, max_model_len_from_model=False,
            enable_expert_parallel=False,  # one device: nothing to split (and the draft may be dense)
        ).resolve(loaded.config)
        params, loaded.params = loaded.params, None
        self.runner = ModelRunner(loaded.config, config, params, attention_impl, mesh)
        self.config = self.runner.config
        self.target_vocab_size = target_config.vocab_size
        self.allocator = PageAllocator(self.runner.num_pages, config.page_size)
        self.slots = SlotAllocator(config.max_num_seqs)
        self.shadows: dict[int, _Shadow] = {}
        self.source = loaded.source

    def warmup(self) -> WarmupReport:
        return self.runner.warmup()

    # ---- proposing ----------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        self.release_finished()
        shadows, wanted = [], []
        for seq, limit in zip(seqs, limits):
            shadow = self._shadow_for(seq, limit)
            if shadow is not None:
                shadows.append(shadow)
                wanted.append(limit)
        if not shadows:
            return [[] for _ in seqs]
        steps = self._catch_up(shadows) + self._chain(shadows, wanted)
        drafts = self._read_drafts(steps, shadows, wanted)
        by_seq = {id(s.target): d for s, d in zip(shadows, drafts)}
        return [by_seq.get(id(seq), []) for seq in seqs]

    def _shadow_for(self, target: Sequence, limit: int) -> _Shadow | None:
        """The target's shadow, its cached count set back to what still matches the target's
        tokens, with pages for the whole proposal; None if the pool cannot hold it."""
        shadow = self.shadows.get(target.seq_id)
        if shadow is None:
            if not self.slots.num_free:
                return None
            seq = Sequence(target.seq_id, target.request_id, target.index, target.prompt_token_ids, _GREEDY, seed=0)
            seq.output_token_ids = target.output_token_ids  # shared: the shadow sees every new token
            seq.status = SequenceStatus.RUNNING
            seq.slot = self.slots.acquire()
            seq.slot_joined = True
            shadow = self.shadows[target.seq_id] = _Shadow(seq, target)
        seq = shadow.seq
        # Its cache holds what the target kept of the drafts it fed; the last token is always
        # fed again (its logits give the first draft), so at least one token is uncomputed.
        seq.num_computed_tokens = min(seq.num_computed_tokens, shadow.fed_from + self._kept_drafts(shadow),
                                      target.num_tokens - 1)
        shadow.fed_drafts = ()
        # Positions fed: the uncomputed tokens, then limit - 1 drafts (the last is not fed).
        if not self.allocator.grow_to(seq.page_ids, target.num_tokens + limit - 1):
            return None
        return shadow

    @staticmethod
    def _kept_drafts(shadow: _Shadow) -> int:
        """How many of the drafts the last chain fed the target kept, as a prefix."""
        kept = shadow.target.tokens(shadow.fed_from, shadow.fed_from + len(shadow.fed_drafts))
        n = 0
        while n < len(kept) and kept[n] == shadow.fed_drafts[n]:
            n += 1
        return n

    def _catch_up(self, shadows: list[_Shadow]) -> list[tuple[ScheduledBatch, object]]:
        """Draft steps over every shadow's uncomputed tokens, within the token budget each; the
        row that reaches a shadow's last token samples its first draft."""
        state = self.runner.batch_state
        for shadow in shadows:
            state.sampled_last[shadow.seq.slot] = False  # the host holds every token it feeds now
        steps, todo = [], list(shadows)
        while todo:
            scheduled, budget, rest = ScheduledBatch(), self.config.max_num_batched_tokens, []
            for shadow in todo:
                seq = shadow.seq
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if n == 0:  # the budget ran out: next step
                    rest.append(shadow)
                    continue
                start = seq.num_computed_tokens
                seq.num_computed_tokens += n
                scheduled.add(seq, n, start, samples=seq.num_computed_tokens == seq.num_tokens)
                budget -= n
                if seq.num_computed_tokens < seq.num_tokens:
                    rest.append(shadow)
            steps.append((scheduled, self.runner.dispatch(scheduled)))
            todo = rest
        return steps

    def _chain(self, shadows: list[_Shadow], wanted: list[int]) -> list[tuple[ScheduledBatch, object]]:
        """Steps 2 .. k: each shadow still wanting drafts feeds the one it sampled last (from the
        device) and samples the next."""
        steps = []
        for i in range(1, max(wanted)):
            scheduled = ScheduledBatch()
            for shadow, limit in zip(shadows, wanted):
                if i < limit:
                    seq = shadow.seq
                    scheduled.add(seq, 1, seq.num_computed_tokens, samples=True)
                    seq.num_computed_tokens += 1
            steps.append((scheduled, self.runner.dispatch(scheduled)))
        return steps

    def _read_drafts(self, steps, shadows: list[_Shadow], wanted: list[int]) -> list[list[int]]:
        drafts: dict[int, list[int]] = {id(s.seq): [] for s in shadows}
        for scheduled, pending in steps:
            tokens = pending.result().tokens.tolist()
            for row, (seq, samples) in enumerate(zip(scheduled.seqs, scheduled.samples)):
                if samples:
                    drafts[id(seq)].append(tokens[row])
        out = []
        for shadow, limit in zip(shadows, wanted):
            proposal = drafts[id(shadow.seq)][:limit]
            shadow.fed_from = shadow.target.num_tokens
            shadow.fed_drafts = tuple(proposal[:limit - 1])  # all but the last were fed to the chain
            # A draft vocabulary larger than the target's: a token the target lacks ends the run.
            valid = next((i for i, t in enumerate(proposal) if t >= self.target_vocab_size), len(proposal))
            out.append(proposal[:valid])
        return out

    def release_finished(self) -> None:
        """Pages and slots back from the shadows of sequences no longer running (finished,
        aborted, preempted: a preempted one starts a new shadow when it runs again)."""
        for seq_id, shadow in list(self.shadows.items()):
            if shadow.target.status is not SequenceStatus.RUNNING:
                self.allocator.free(shadow.seq.page_ids)
                shadow.seq.page_ids = []
                self.slots.release(shadow.seq.slot)
                del self.shadows[seq_id]
