"""Data-parallel checks on 4 forced host devices, run as a subprocess by
tests/engine/test_replicas.py (JAX fixes its device count when it starts; the suite runs on one).
Prints one JSON line, "RESULT {...}", that the tests assert on.

    python tests/data_parallel_worker.py tokens MODEL_DIR   one engine vs 4 replicas, 2 x TP 2, 2 x PP 2
    python tests/data_parallel_worker.py serve MODEL_DIR    the async front: spread, prefix affinity, abort,
                                                            metrics, shutdown
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import asyncio  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

from orca_jax import SamplingParams  # noqa: E402
from orca_jax.entrypoints.llm import LLM  # noqa: E402

# One token bucket, a small pool: one program per replica.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16, page_size=8, num_pages=48,
              max_model_len=128, compilation_cache_dir=None)
PROMPT_LENGTHS = (5, 19, 11, 7, 23, 9, 13, 3, 17, 6, 12, 8)  # 19, 23 > 16: chunked prefills beside decodes


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=n).tolist() for n in PROMPT_LENGTHS]


def sampling(i: int) -> SamplingParams:
    """Greedy for odd prompts, seeded sampling (top-p, a penalty) for even ones."""
    if i % 2:
        return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, max_tokens=6, ignore_eos=True,
                          repetition_penalty=1.2)


def tokens_run(model_dir: str) -> dict:
    results = {}
    for name, layout in [("one", {}), ("dp4", {"data_parallel_size": 4}),
                         ("dp2_tp2", {"data_parallel_size": 2, "tensor_parallel_size": 2}),
                         ("dp2_pp2", {"data_parallel_size": 2, "pipeline_parallel_size": 2})]:
        llm = LLM(model=model_dir, **ENGINE, **layout)
        batch = prompts(llm.engine.model_config.vocab_size)
        outputs = llm.generate(batch, [sampling(i) for i in range(len(batch))], use_tqdm=False)
        results[name] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "steps_per_replica": [e.num_steps for e in llm.replicas],
            "devices_per_replica": [sorted(d.id for d in e.runner.mesh.devices.flat) if e.runner.mesh is not None
                                    else None for e in llm.replicas],
            "pages_in_use": [e.allocator.num_used for e in llm.replicas],
        }
        if name == "dp4":
            results["dp4_failures"] = failure_checks(llm, batch)
    return results


def failure_checks(llm: LLM, batch: list[list[int]]) -> dict:
    """A bad prompt among good ones, then a replica whose step fails mid-run: generate raises,
    every replica is left with nothing live and no page held, and the next call works."""
    from orca_jax.errors import RequestError

    result = {}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    bad = batch[:5] + [[10**9]] + batch[5:]  # a token id past the vocabulary
    try:
        llm.generate(bad, params, use_tqdm=False)
        result["bad_prompt"] = "accepted"
    except RequestError as exc:
        result["bad_prompt"] = f"RequestError: {exc}"
    result["after_bad_prompt"] = _leftovers(llm)
    victim, calls = llm.replicas[2], []
    real_step = victim.step

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    victim.step = failing_step
    try:
        llm.generate(batch, params, use_tqdm=False)
        result["step_failure"] = "not raised"
    except RuntimeError as exc:
        result["step_failure"] = str(exc)
    victim.step = real_step
    result["after_step_failure"] = _leftovers(llm)
    again = llm.generate(batch, [sampling(i) for i in range(len(batch))], use_tqdm=False)
    result["tokens_after"] = [list(o.outputs[0].token_ids) for o in again]
    return result


def _leftovers(llm: LLM) -> list[tuple[bool, int]]:
    return [(e.has_unfinished_requests(), e.allocator.num_used) for e in llm.replicas]


async def serve_checks(model_dir: str) -> dict:
    from orca_jax.engine.replicas import build_replicas
    from orca_jax.entrypoints.server import ServerSettings, build_app
    from orca_jax.errors import RequestError

    engines = build_replicas(LLM_CONFIG(model_dir))
    front, app = build_app(engines, ServerSettings("tiny"), max_waiting_requests=64)
    front.start(asyncio.get_running_loop())
    vocab = engines[0].model_config.vocab_size
    rng = np.random.default_rng(1)
    result: dict = {}

    # 1. A burst of 24 equal requests, queued before any step ran: 6 per replica, 4 running and
    # 2 waiting on each (max_num_seqs 4). Sampled while it runs: whether any replica sat idle
    # while another had a queue.
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    streams = [await front.add_request(f"burst{i}", rng.integers(3, vocab, size=9).tolist(), params)
               for i in range(24)]
    result["burst_loads"] = front.loads()
    result["burst_replicas"] = [s.replica for s in streams]
    drained = asyncio.gather(*[_drain(s) for s in streams])
    samples = []
    while not drained.done():
        samples.append([(s.num_running, s.num_waiting) for s in front.replica_stats()])
        await asyncio.sleep(0.005)
    await drained
    result["burst_samples"] = samples

    # 2. Prefix affinity: a 4-page shared prefix; its first request lands somewhere, and later
    # ones that share it follow it there (and hit that replica's prefix cache).
    shared = rng.integers(3, vocab, size=32).tolist()
    first = await front.add_request("prefix0", shared + [5, 6], params)
    await _drain(first)
    holder = first.replica
    hits_before = [s.prefix_cache_hits for s in front.replica_stats()]
    followers = []
    for i in range(1, 4):  # one after another: the loads stay equal
        followers.append(await front.add_request(f"prefix{i}", shared + [7 + i], params))
        await _drain(followers[-1])
    result["prefix_holder"] = holder
    result["prefix_followers_at"] = [s.replica for s in followers]
    result["prefix_hits_gained"] = [s.prefix_cache_hits - h for s, h in zip(front.replica_stats(), hits_before)]
    # Together, so the holder's load grows past the slack: the last ones go elsewhere.
    crowd = [await front.add_request(f"crowd{i}", shared + [20 + i], params) for i in range(4)]
    result["crowd_at"] = [s.replica for s in crowd]
    result["slack"] = front.router.slack
    await asyncio.gather(*[_drain(s) for s in crowd])

    # 3. A duplicate id is refused across replicas; an abort frees its replica's pages.
    long = await front.add_request("long", rng.integers(3, vocab, size=9).tolist(),
                                   SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    try:
        await front.add_request("long", [3, 4, 5], params)
        result["duplicate_refused"] = False
    except RequestError:
        result["duplicate_refused"] = True
    outputs = [await long.__anext__()]  # running: it has its first token
    front.abort("long")
    outputs += [o async for o in long]
    result["abort_finish"] = outputs[-1].outputs[0].finish_reason if outputs else None
    await asyncio.sleep(0.3)
    result["pages_after"] = [e.allocator.num_used for e in engines]
    result["live_after"] = front.loads()
    result["routed"] = {f"{r}:{why}": n for (r, why), n in front.routed.items()}
    result["metrics"] = await _get(app, "/metrics")
    result["health"] = await _get(app, "/health")

    # 4. Shutdown: the live request is aborted on its replica; every replica stops.
    last = await front.add_request("last", [3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    await last.__anext__()
    front.begin_shutdown()
    outputs = [o async for o in last]
    result["shutdown_last"] = outputs[-1].outputs[0].finish_reason if outputs else None
    result["pages_after_shutdown"] = [e.allocator.num_used for e in engines]
    await asyncio.to_thread(front.shutdown)
    result["running_after_shutdown"] = front.is_running
    return result


def LLM_CONFIG(model_dir: str):
    from orca_jax.config import EngineConfig

    return EngineConfig(model=model_dir, data_parallel_size=4, **ENGINE)


async def _get(app, path: str) -> str:
    """The app's answer, in-process (httpx's ASGI transport runs no lifespan: the front is
    already started here)."""
    import httpx

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dp") as client:
        return (await client.get(path)).text


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def main(argv: list[str]) -> int:
    mode, model_dir = argv
    if mode == "tokens":
        result = tokens_run(model_dir)
    elif mode == "serve":
        result = asyncio.run(serve_checks(model_dir))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
