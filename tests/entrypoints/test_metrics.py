"""The engine-state series of /metrics, from a stats snapshot (no engine needed)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from orca_jax.engine.async_engine import EngineStats
from orca_jax.entrypoints.metrics import ServerMetrics


def scrape(stats: EngineStats) -> dict[str, float]:
    text = ServerMetrics(lambda: stats).render().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_speculative_decoding_counters_and_mean_acceptance_length():
    samples = scrape(EngineStats(spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12,
                                 spec_decode_num_accepted_tokens=6))
    assert samples["orca_spec_decode_num_drafts_total"] == 4
    assert samples["orca_spec_decode_num_draft_tokens_total"] == 12
    assert samples["orca_spec_decode_num_accepted_tokens_total"] == 6
    assert samples["orca_spec_decode_mean_acceptance_length"] == 1 + 6 / 4


def test_mean_acceptance_length_is_zero_before_any_draft():
    assert scrape(EngineStats())["orca_spec_decode_mean_acceptance_length"] == 0.0
