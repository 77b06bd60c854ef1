"""Data parallelism (orca_jax/engine/replicas.py, data_parallel.py, router.py) on 4 forced host
devices: tests/data_parallel_worker.py runs the engines in a subprocess (JAX fixes its device
count at start; this suite runs on one) and reports JSON. How replicas are laid out and what an
engine refuses are tested here, in-process."""

from __future__ import annotations

import pytest

from orca_jax.config import EngineConfig
from orca_jax.engine import replicas


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_factory):
    return str(tiny_llama_factory(seed=5))


@pytest.fixture(scope="module")
def token_runs(tiny_dir, run_parallel_worker) -> dict:
    return run_parallel_worker("tokens", tiny_dir, worker="data_parallel_worker.py")


@pytest.fixture(scope="module")
def serve_run(tiny_dir, run_parallel_worker) -> dict:
    return run_parallel_worker("serve", tiny_dir, worker="data_parallel_worker.py")


@pytest.mark.parametrize("layout", ["dp4", "dp2_tp2", "dp2_pp2"])
def test_replicas_give_every_request_the_tokens_of_one_engine(token_runs, layout):
    """Greedy and seeded requests (odd and even prompts): the same tokens whichever replica,
    and whatever its own tensor or pipeline layout, ran them."""
    assert token_runs[layout]["tokens"] == token_runs["one"]["tokens"]
    assert all(len(t) == 6 for t in token_runs["one"]["tokens"])


def test_offline_failures_leave_every_replica_clean(token_runs):
    failures = token_runs["dp4_failures"]
    assert failures["bad_prompt"].startswith("RequestError")
    assert failures["after_bad_prompt"] == [[False, 0]] * 4
    assert failures["step_failure"] == "injected step failure"
    assert failures["after_step_failure"] == [[False, 0]] * 4
    assert failures["tokens_after"] == token_runs["one"]["tokens"]


def test_each_replica_steps_on_its_own_devices(token_runs):
    assert token_runs["dp4"]["devices_per_replica"] == [[0], [1], [2], [3]]
    assert token_runs["dp2_tp2"]["devices_per_replica"] == [[0, 1], [2, 3]]
    assert token_runs["dp2_pp2"]["devices_per_replica"] == [[0, 1], [2, 3]]
    for layout in ("dp4", "dp2_tp2", "dp2_pp2"):
        run = token_runs[layout]
        assert all(steps > 0 for steps in run["steps_per_replica"]), run  # every replica had work
        assert run["pages_in_use"] == [0] * len(run["pages_in_use"])
    # 12 prompts over 4 replicas: each one ran about a quarter of the single engine's steps.
    assert max(token_runs["dp4"]["steps_per_replica"]) < token_runs["one"]["steps_per_replica"][0] / 2


def test_a_burst_spreads_and_no_replica_idles_while_another_queues(serve_run):
    assert serve_run["burst_loads"] == [6, 6, 6, 6]
    assert sorted(serve_run["burst_replicas"]) == sorted(list(range(4)) * 6)
    samples = serve_run["burst_samples"]
    assert any(any(waiting for _, waiting in sample) for sample in samples), "the burst never queued"
    for sample in samples:
        if any(waiting for _, waiting in sample):
            assert all(running or waiting for running, waiting in sample), sample


def test_a_shared_prefix_follows_the_replica_that_holds_it(serve_run):
    holder = serve_run["prefix_holder"]
    assert serve_run["prefix_followers_at"] == [holder] * 3
    # The holder's own prefix cache served them: 3 requests x 4 full pages x 8 tokens.
    gained = serve_run["prefix_hits_gained"]
    assert gained[holder] == 3 * 32 and sum(gained) == gained[holder]
    # Sent together, the holder takes them only while its load stays within the slack.
    crowd, slack = serve_run["crowd_at"], serve_run["slack"]
    assert crowd[: slack + 1] == [holder] * (slack + 1)
    assert any(r != holder for r in crowd)
    assert serve_run["routed"][f"{holder}:prefix"] >= 3 + slack


def test_abort_duplicates_metrics_and_shutdown_are_per_replica(serve_run):
    assert serve_run["duplicate_refused"]
    assert serve_run["abort_finish"] == "abort"
    assert serve_run["pages_after"] == [0, 0, 0, 0] and serve_run["live_after"] == [0, 0, 0, 0]
    metrics = serve_run["metrics"]
    for r in range(4):
        assert f'orca_num_requests_running{{replica="{r}"}}' in metrics
        assert f'orca_kv_pages_total{{replica="{r}"}} 47.0' in metrics
    assert f'orca_prefix_cache_hits_total{{replica="{serve_run["prefix_holder"]}"}}' in metrics
    assert 'orca_dp_routed_requests_total{reason="prefix",replica=' in metrics
    assert "orca_requests_total" in metrics  # the request families stay one per server
    assert serve_run["health"] == '{"status":"ok"}'
    assert serve_run["shutdown_last"] == "abort"
    assert serve_run["pages_after_shutdown"] == [0, 0, 0, 0]
    assert serve_run["running_after_shutdown"] is False


# ---- in-process: layout and refusals ------------------------------------------------------
class _Device:
    def __init__(self, i):
        self.id, self.platform = i, "cpu"


def test_device_groups_are_consecutive_tensor_times_pipeline_blocks():
    devices = [_Device(i) for i in range(8)]
    config = EngineConfig(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2)
    groups = replicas.replica_device_groups(config, devices)
    assert [[d.id for d in g] for g in groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    groups = replicas.replica_device_groups(EngineConfig(data_parallel_size=3), devices)
    assert [[d.id for d in g] for g in groups] == [[0], [1], [2]]


def test_too_few_devices_are_refused_with_the_flag_that_adds_them():
    config = EngineConfig(data_parallel_size=4, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs 8 devices.*xla_force_host_platform_device_count=8"):
        replicas.replica_device_groups(config, [_Device(i) for i in range(4)])


def test_one_engine_is_one_replica():
    from orca_jax.engine.engine import LLMEngine

    with pytest.raises(ValueError, match="one LLMEngine is one replica"):
        LLMEngine(EngineConfig(data_parallel_size=2))  # refused before anything loads
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        EngineConfig(data_parallel_size=0)
