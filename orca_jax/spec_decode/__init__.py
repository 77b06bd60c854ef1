"""Speculative decoding: proposers offer draft tokens per sequence, one target step verifies
them all on the flattened token axis (a speculating sequence contributes 1 + k query tokens,
like a short prefill chunk over its cached prefix), and a rejection rule keeps the longest
valid prefix plus one token from the target.

    ngram.py         NgramProposer: prompt lookup in the sequence's own history
    draft_model.py   DraftModelProposer: a small model on its own runner, cache and buckets
    proposing.py     which sequences propose this step (backoff after failed proposals)

SpeculativeConfig (vLLM's speculative_config keys) lives in orca_jax/config/speculative.py, with
the EngineConfig that holds it: every layer reads the configuration, so it sits at the bottom.
verify_drafts, the acceptance rule, runs inside the jitted step, so it lives with the runner
that calls it: orca_jax/worker/rejection.py.
"""
