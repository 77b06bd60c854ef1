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


def test_data_parallel_replicas_get_a_label_each_and_routing_counts():
    per_replica = {0: EngineStats(num_running=2, kv_pages_total=10), 1: EngineStats(num_waiting=3, kv_pages_total=10)}
    routed = {(0, "least_loaded"): 4, (1, "prefix"): 2}
    text = ServerMetrics(lambda: per_replica, routed=lambda: routed).render().decode()
    assert 'orca_num_requests_running{replica="0"} 2.0' in text
    assert 'orca_num_requests_waiting{replica="1"} 3.0' in text
    assert 'orca_engine_steps_total{replica="1"} 0.0' in text
    assert "orca_num_requests_running 2.0" not in text  # no unlabelled sample beside the replicas'
    assert 'orca_dp_routed_requests_total{reason="least_loaded",replica="0"} 4.0' in text
    assert 'orca_dp_routed_requests_total{reason="prefix",replica="1"} 2.0' in text
