"""`orca-jax bench serve`: Orca's trace over HTTP against any OpenAI-compatible server (orca_jax's
own, or vLLM for comparison), like vLLM's `bench serve`.

Requests are sent open-loop at their Poisson arrival times to `/v1/completions`, streamed,
with the prompt as token ids, `max_tokens` set to the drawn output length, `ignore_eos` (a
vLLM extension orca_jax shares) and greedy decoding. Per request the client records its
scheduled arrival, the time of every streamed chunk that carries text and the end of the
stream; the token count is the server's usage (`completion_tokens`) when reported, else the
number of chunks. Reported: requests/s, output tokens/s, TTFT, TPOT, inter-token latency,
end-to-end and normalized latency (mean, p50, p90, p99).

httpx is needed here (it comes with the `test` and `bench` extras); tqdm draws the progress bar.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from orca_jax.bench.latency import RequestTiming, summarize
from orca_jax.bench.trace import Trace


@dataclasses.dataclass(frozen=True)
class ServeTarget:
    base_url: str  # e.g. http://127.0.0.1:8000 (without /v1)
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    timeout_s: float = 600.0
    max_concurrency: int | None = None  # None: open loop, no cap


def import_httpx():
    try:
        import httpx
    except ImportError:
        raise RuntimeError("`orca-jax bench serve` needs httpx: pip install httpx") from None
    return httpx


def _headers(target: ServeTarget) -> dict[str, str]:
    return {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}


async def served_model(client, target: ServeTarget) -> str:
    if target.model:
        return target.model
    response = await client.get(f"{target.base_url}/v1/models", headers=_headers(target))
    response.raise_for_status()
    return response.json()["data"][0]["id"]


@dataclasses.dataclass(frozen=True)
class PromptVocabulary:
    """Which token ids random prompts may use: below `size`, minus `excluded` (special tokens,
    which would make a tokenizer or a stop rule misbehave), and where the numbers came from."""

    size: int
    excluded: tuple[int, ...]
    source: str


def vocabulary_from_tokenizer(name_or_path: str, source: str) -> PromptVocabulary:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    return PromptVocabulary(len(tokenizer), tuple(tokenizer.all_special_ids), source)


def served_vocabulary(target: ServeTarget) -> PromptVocabulary:
    """The served model's vocabulary, asked of the server: orca_jax lists `vocab_size` and
    `special_token_ids` in /v1/models; other servers (vLLM) list the model's path or hub id as
    `root`, whose tokenizer is then loaded. Raises ValueError when neither works."""
    httpx = import_httpx()
    try:
        response = httpx.get(f"{target.base_url}/v1/models", headers=_headers(target), timeout=target.timeout_s)
        response.raise_for_status()
        models = response.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise ValueError(f"could not list the models of {target.base_url} ({type(exc).__name__}: {exc}); "
                         "pass --tokenizer or --vocab-size") from None
    entry = next((m for m in models if m["id"] == target.model), models[0]) if target.model else models[0]
    if isinstance(entry.get("vocab_size"), int):
        return PromptVocabulary(entry["vocab_size"], tuple(entry.get("special_token_ids") or ()),
                                f"{target.base_url}/v1/models")
    root = entry.get("root") or entry["id"]
    try:
        return vocabulary_from_tokenizer(root, f"tokenizer of {root}")
    except Exception as exc:  # noqa: BLE001 - any failure means: ask the user
        raise ValueError(f"the server lists no vocabulary for {entry['id']!r} and its tokenizer {root!r} could "
                         f"not be loaded ({type(exc).__name__}); pass --tokenizer or --vocab-size") from None


@dataclasses.dataclass
class _Outcome:
    timing: RequestTiming | None = None
    error: str | None = None


async def _one_request(client, target: ServeTarget, model: str, prompt: list[int], max_tokens: int,
                       arrival: float) -> _Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    chunk_times: list[float] = []
    usage_tokens = None
    try:
        async with client.stream("POST", f"{target.base_url}/v1/completions", json=body,
                                 headers=_headers(target)) as response:
            if response.status_code != 200:
                return _Outcome(error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return _Outcome(error=str(event["error"]))
                if any(c.get("text") for c in event.get("choices") or []):
                    chunk_times.append(time.perf_counter())
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point, not a crash
        return _Outcome(error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if not chunk_times:
        return _Outcome(error="the stream carried no text")
    n_tokens = usage_tokens or len(chunk_times)
    return _Outcome(RequestTiming(arrival, chunk_times[0], end, n_tokens, tuple(chunk_times)))


async def replay(trace: Trace, target: ServeTarget, *, show_progress: bool = True) -> dict:
    """Send every request of `trace` at its arrival time; return the summary and the failures."""
    httpx = import_httpx()
    from tqdm.auto import tqdm

    limits = httpx.Limits(max_connections=target.max_concurrency or trace.num_requests + 8)
    async with httpx.AsyncClient(timeout=target.timeout_s, limits=limits) as client:
        model = await served_model(client, target)
        gate = asyncio.Semaphore(target.max_concurrency) if target.max_concurrency else None
        bar = tqdm(total=trace.num_requests, desc="requests", disable=not show_progress)

        async def scheduled(i: int, start: float) -> _Outcome:
            arrival = start + trace.arrival_times[i]
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
            if gate:
                async with gate:
                    outcome = await _one_request(client, target, model, trace.prompts[i], trace.output_lens[i], arrival)
            else:
                outcome = await _one_request(client, target, model, trace.prompts[i], trace.output_lens[i], arrival)
            bar.update(1)
            return outcome

        start = time.perf_counter()
        outcomes = await asyncio.gather(*(scheduled(i, start) for i in range(trace.num_requests)))
        bar.close()
    timings = [o.timing for o in outcomes if o.timing is not None]
    errors = [f"request {i}: {o.error}" for i, o in enumerate(outcomes) if o.error is not None]
    wrong_length = [i for i, o in enumerate(outcomes) if o.timing and o.timing.num_output_tokens != trace.output_lens[i]]
    return {
        "model": model,
        "completed": len(timings), "failed": len(errors), "errors": errors[:10],
        "requests_with_unexpected_length": wrong_length,
        "summary": summarize(timings) if timings else None,
    }


def format_report(record: dict) -> str:
    s = record["summary"]
    lines = [f"server: {record['target']['base_url']} model {record['model']}", f"trace: {record['trace']}",
             f"completed {record['completed']}, failed {record['failed']}"]
    lines += [f"  {e}" for e in record["errors"]]
    if s is None:
        return "\n".join(lines)
    lines += [f"duration {s['duration_s']:.2f} s: {s['requests_per_s']:.3f} req/s, "
              f"{s['output_tokens_per_s']:.1f} output tok/s", "", f"{'':26}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for key, label in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "inter-token latency (ms)"),
                       ("e2e_ms", "end-to-end latency (ms)"), ("normalized_latency_ms", "normalized (ms/token)")):
        d = s.get(key) or {}
        lines.append(f"{label:26}" + "".join(f"{'n/a' if d.get(q) is None else format(d[q], '.1f'):>10}"
                                            for q in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)
