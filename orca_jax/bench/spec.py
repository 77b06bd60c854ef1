"""`orca-jax bench spec`: speculative decoding against none, by turns in one process.

Two workloads, each at batch 1, 4 and 16 (one engine per configuration at `max_num_seqs` = the
largest batch; a batch of B keeps B requests in flight):

  copy    "repeat this passage" chat prompts: the instruct model is asked to repeat, word for
          word, a ~330-token public-domain passage (the Gettysburg Address) whose sentences are
          rotated (and, past one rotation, reversed) per request, so the B requests differ.
          `copy_output_len` tokens each, greedy, EOS ignored (the passage is longer than the
          output, so the model is still copying when the length ends it).
  random  Orca's random trace (bench/trace.py: random prompt token ids, input and output
          lengths uniform, at `random_scale`), greedy, EOS ignored; at batch B the first
          `random_requests_per_slot * B` requests of one trace (drawn for the largest batch),
          closed loop with B in flight: the next request joins as soon as one finishes.

Configurations: speculation off (the engine's default, async scheduling), n-gram with
k = `ngram_k` (3 and 5) and the draft-model proposer with k = `draft_k` (3) whose draft is the
target itself: its acceptance is the upper bound any draft model could reach (and, since the
draft costs a full model step per token, its speed is not the point). Every engine is built
once, alike but for `speculative_config` (prefix caching off: a round must not find the
prompts of the round before cached); then for `rounds` rounds every (workload, batch) runs all
configurations by turns, the order flipped every round, so the machine's noise hits each alike.
A step that proposes runs alone (the proposal needs the last token on the host); the engine
falls back to overlapped steps while speculation does not pay, and that backoff starts afresh
in every run (`fresh_speculation`), so a run does not inherit it from the runs before it.

Per run: output tokens/s over the run; TPOT, the median over requests of (last token time -
first token time) / (tokens - 1), stamped when `engine.step()` returns; steps; the engine's
counters (rows that verified drafts, draft tokens verified, accepted), the emitted tokens and
the mean acceptance length (1 + accepted / rows, vLLM's); where the time went, from the step
timeline and a timer on the proposer: device busy, device idle (waiting for the host: the lost
async overlap plus the proposal), proposal seconds. Ratios are to the off run of the same round.
Every greedy output is compared token by token with the off run's: speculation must not change
it (a difference is reported, and the command fails after writing the record).

Targets: n-gram >= 2x the output tokens/s of off at batch 1 on the copy workload, and no worse
than -5% on the random trace (a sequence whose proposals keep failing stops proposing for a
while, so text that does not repeat costs little).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any

from orca_jax.bench import environment
from orca_jax.bench.driver import BenchmarkError, check_pages_returned
from orca_jax.bench.trace import ORCA_INPUT_RANGE, ORCA_OUTPUT_RANGE, make_trace, scaled_range

TARGET_COPY_SPEEDUP = 2.0  # n-gram over off, output tok/s, copy workload, batch 1
TARGET_RANDOM_MAX_LOSS = 0.05  # n-gram against off, output tok/s, random trace, every batch size
WORKLOADS = ("copy", "random")

# Abraham Lincoln, the Gettysburg Address (1863, the Bliss copy): public domain. A passage the
# 135M default model copies (it wanders off from some others: asked to repeat the opening of
# Moby-Dick, it writes about Cato).
PASSAGE_SENTENCES = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal.",
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and so "
    "dedicated, can long endure.",
    "We are met on a great battle-field of that war.",
    "We have come to dedicate a portion of that field, as a final resting place for those who here gave their "
    "lives that that nation might live.",
    "It is altogether fitting and proper that we should do this.",
    "But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this ground.",
    "The brave men, living and dead, who struggled here, have consecrated it, far above our poor power to add or "
    "detract.",
    "The world will little note, nor long remember what we say here, but it can never forget what they did here.",
    "It is for us the living, rather, to be dedicated here to the unfinished work which they who fought here have "
    "thus far so nobly advanced.",
    "It is rather for us to be here dedicated to the great task remaining before us -- that from these honored dead "
    "we take increased devotion to that cause for which they gave the last full measure of devotion -- that we here "
    "highly resolve that these dead shall not have died in vain -- that this nation, under God, shall have a new "
    "birth of freedom -- and that government of the people, by the people, for the people, shall not perish from "
    "the earth.",
)
COPY_INSTRUCTION = "Repeat the following passage exactly, word for word:\n\n"


@dataclasses.dataclass(frozen=True)
class SpecSettings:
    model: str | None = None
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    workloads: tuple[str, ...] = WORKLOADS
    ngram_k: tuple[int, ...] = (3, 5)
    draft_k: tuple[int, ...] = (3,)
    draft_model: str | None = None  # None: the target model as its own draft (the acceptance upper bound)
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    rounds: int = 2
    copy_output_len: int = 96
    copy_sentences: int = len(PASSAGE_SENTENCES)  # the first this many sentences of the passage
    random_scale: float = 0.25  # Orca's lengths times this: input U[8, 128], output U[1, 32]
    random_requests_per_slot: int = 2  # random trace at batch B: B * this requests, B in flight
    max_num_batched_tokens: int = 256
    page_size: int = 16
    dtype: str = "float32"
    seed: int = 0
    switch_interval_s: float = 1e-4  # sys.setswitchinterval while timing: the timeline stamps device finishes promptly

    def __post_init__(self):
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be positive, got {self.batch_sizes}")
        if not self.workloads or any(w not in WORKLOADS for w in self.workloads):
            raise ValueError(f"workloads must be among {WORKLOADS}, got {self.workloads}")
        if any(k < 1 for k in (*self.ngram_k, *self.draft_k)):
            raise ValueError("speculative token counts must be >= 1")
        if not 1 <= self.copy_sentences <= len(PASSAGE_SENTENCES):
            raise ValueError(f"copy_sentences must be in [1, {len(PASSAGE_SENTENCES)}], got {self.copy_sentences}")
        needed = max(self.batch_sizes) * (1 + max((*self.ngram_k, *self.draft_k), default=0))
        if self.max_num_batched_tokens < needed:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must hold every sequence of "
                             f"the largest batch with its drafts ({needed})")

    @classmethod
    def quick(cls, **overrides) -> SpecSettings:
        """Seconds on a tiny model (the tests): short outputs, batch 1 and 2, a token budget of 8
        (one step program per engine) and k = 3 for both proposers (the same program)."""
        return cls(**{**dict(batch_sizes=(1, 2), ngram_k=(3,), draft_k=(3,), copy_output_len=16, copy_sentences=2,
                             random_scale=0.1, max_num_batched_tokens=8, page_size=8), **overrides})

    @property
    def configs(self) -> dict[str, dict | None]:
        """Label -> speculative_config, off first."""
        lookup = dict(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
        configs: dict[str, dict | None] = {"off": None}
        configs.update({f"ngram k={k}": dict(method="ngram", num_speculative_tokens=k, **lookup)
                        for k in self.ngram_k})
        configs.update({f"draft k={k}": dict(method="draft_model", num_speculative_tokens=k, model=self.draft_model)
                        for k in self.draft_k})
        return configs


# ---- the workloads -------------------------------------------------------------------------------
def passage(i: int, num_sentences: int) -> str:
    """Request i's passage: the sentences rotated by i, in reverse order every other rotation."""
    sentences = list(PASSAGE_SENTENCES[:num_sentences])
    if (i // num_sentences) % 2:
        sentences.reverse()
    r = i % num_sentences
    return " ".join(sentences[r:] + sentences[:r])


def copy_prompts(tokenizer, num: int, s: SpecSettings) -> list[list[int]]:
    from orca_jax.entrypoints.chat_template import apply_chat_template

    return [apply_chat_template(tokenizer, [{"role": "user", "content": COPY_INSTRUCTION + passage(i, s.copy_sentences)}])
            for i in range(num)]


def workload_requests(engine, s: SpecSettings) -> dict[str, list[tuple[list[int], int]]]:
    """Per workload, (prompt ids, output tokens) of the requests of the largest batch; a batch of
    B takes the first ones (copy: B; random: B * random_requests_per_slot)."""
    largest = max(s.batch_sizes)
    requests = {}
    if "copy" in s.workloads:
        requests["copy"] = [(p, s.copy_output_len) for p in copy_prompts(engine.tokenizer, largest, s)]
    if "random" in s.workloads:
        special = tuple(getattr(engine.tokenizer, "all_special_ids", ()) or ())
        trace = make_trace(largest * s.random_requests_per_slot, s.random_scale, s.seed,
                           vocab_size=engine.model_config.vocab_size, exclude_ids=special)
        requests["random"] = list(zip(trace.prompts, trace.output_lens))
    return requests


def batch_requests(requests: list[tuple[list[int], int]], workload: str, batch: int, s: SpecSettings):
    return requests[:batch * (s.random_requests_per_slot if workload == "random" else 1)]


def max_model_len(s: SpecSettings, tokenizer) -> int:
    """The longest request of either workload, page-aligned (small page tables)."""
    longest = 0
    if "copy" in s.workloads:
        longest = max(len(p) for p in copy_prompts(tokenizer, max(s.batch_sizes), s)) + s.copy_output_len
    if "random" in s.workloads:
        longest = max(longest, scaled_range(ORCA_INPUT_RANGE, s.random_scale)[1]
                      + scaled_range(ORCA_OUTPUT_RANGE, s.random_scale)[1])
    return -(-longest // s.page_size) * s.page_size


# ---- measuring -----------------------------------------------------------------------------------
class ProposeTimer:
    """Seconds in `engine.speculation.propose` (host lookups, and for a draft model its steps),
    while entered."""

    def __init__(self, engine):
        self.speculation = engine.speculation
        self.seconds = 0.0
        self.calls = 0

    def __enter__(self):
        if self.speculation is not None:
            real = self.speculation.propose

            def timed(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return real(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - started
                    self.calls += 1

            self.speculation.propose = timed
        return self

    def __exit__(self, *exc):
        if self.speculation is not None:
            del self.speculation.propose  # the class's method again


class RowCounter:
    """Rows that emitted tokens, and the tokens, over every step postprocessed while entered
    (wraps the scheduler's postprocess: a `step()` call may complete two steps when the engine
    overlaps steps that do not propose)."""

    def __init__(self, engine):
        self.scheduler = engine.scheduler
        self.rows = 0
        self.tokens = 0

    def __enter__(self):
        real = self.scheduler.postprocess

        def counting(*args, **kwargs):
            update = real(*args, **kwargs)
            self.rows += len({id(seq) for _, seq in update.advanced})
            self.tokens += len(update.advanced)
            return update

        self.scheduler.postprocess = counting
        return self

    def __exit__(self, *exc):
        del self.scheduler.postprocess


def build_engine(s: SpecSettings, spec: dict | None, model_len: int):
    from orca_jax.engine.engine import LLMEngine

    num_seqs = max(s.batch_sizes)
    return LLMEngine(model=s.model, dtype=s.dtype, max_num_seqs=num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                     page_size=s.page_size, max_model_len=model_len, seed=s.seed, enable_prefix_caching=False,
                     num_pages=num_seqs * (model_len // s.page_size) + 1, speculative_config=spec)


def warm_up(engine, requests: dict[str, list[tuple[list[int], int]]]) -> None:
    """A short request of each workload through every host path (proposer, verification,
    detokenizer); the engine compiled its step programs when it was built."""
    from orca_jax.core.sampling_params import SamplingParams

    for name, reqs in requests.items():
        engine.add_request(f"warmup-{name}", reqs[0][0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def fresh_speculation(engine) -> None:
    """Start the run with the engine's speculation as built: its backoff to overlapped steps
    (how long, how often it did not pay) is state a run would otherwise inherit from the
    runs before it on the same engine, which differ in order from round to round."""
    spec = engine.speculation
    if spec is not None:
        engine.speculation = type(spec)(spec.config, spec.proposer, spec.overlap_allowed)


def counters(engine) -> tuple[int, int, int]:
    sched = engine.scheduler
    return sched.num_spec_rows, sched.num_draft_tokens, sched.num_accepted_tokens


def timed_run(engine, requests: list[tuple[list[int], int]], concurrency: int, tag: str) -> dict[str, Any]:
    """`requests` with at most `concurrency` in flight (the next joins as soon as one finishes);
    times, counters, step timeline sums, and each request's token ids (key "tokens", popped by
    the caller after the comparison)."""
    from orca_jax.core.sampling_params import SamplingParams
    from orca_jax.worker.compile_guard import compile_count
    from orca_jax.engine.step_timing import derive

    n = len(requests)
    fresh_speculation(engine)
    compiles, steps, before = compile_count(), engine.num_steps, counters(engine)
    added, first, finish, tokens = {}, {}, {}, {}
    timeline = engine.timeline
    timeline.clear()
    timeline.enable()
    try:
        with ProposeTimer(engine) as proposing, RowCounter(engine) as rows_out:
            started = time.perf_counter()

            def add(i):
                prompt, out_len = requests[i]
                engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=out_len, temperature=0.0,
                                                                        ignore_eos=True))
                added[i] = time.perf_counter()

            next_request = min(concurrency, n)
            for i in range(next_request):
                add(i)
            while engine.has_unfinished_requests():
                outputs = engine.step()
                now = time.perf_counter()
                for out in outputs:
                    if out.error is not None:
                        raise BenchmarkError(f"request {out.request_id} failed: {out.error}")
                    i = int(out.request_id.rsplit("-", 1)[1])
                    if out.outputs[0].delta_token_ids:
                        first.setdefault(i, now)
                    if out.finished:
                        finish[i], tokens[i] = now, list(out.outputs[0].token_ids)
                        if next_request < n:
                            add(next_request)
                            next_request += 1
            duration = time.perf_counter() - started
        timeline.wait_idle()
        records = list(timeline.records)
    finally:
        timeline.disable()
        timeline.clear()
    check_pages_returned(engine)
    proposer_allocator = getattr(getattr(engine.speculation, "proposer", None), "allocator", None)
    if proposer_allocator is not None and proposer_allocator.num_used:
        raise BenchmarkError(f"{proposer_allocator.num_used} draft-model KV pages still in use after the run")
    for i, (_, out_len) in enumerate(requests):
        if len(tokens.get(i, ())) != out_len:
            raise BenchmarkError(f"request {i} made {len(tokens.get(i, ()))} tokens, expected {out_len}")
    rows, drafted, accepted = (after - b for after, b in zip(counters(engine), before))
    emitted = sum(len(t) for t in tokens.values())
    tpots = [(finish[i] - first[i]) / (len(tokens[i]) - 1) for i in range(n) if len(tokens[i]) > 1]
    steps_taken = engine.num_steps - steps
    derived = derive(records)
    busy = [r["device_step_s"] for r in derived if r["device_step_s"] == r["device_step_s"]]  # NaN: missed
    idle = [r["device_idle_s"] for r in derived if r["device_idle_s"] == r["device_idle_s"]]
    return {
        "num_requests": n, "concurrency": concurrency, "duration_s": duration,
        "output_tokens": emitted, "output_tokens_per_s": emitted / duration,
        "tpot_s": _median(tpots), "ttft_s": _median([first[i] - added[i] for i in range(n)]),
        "engine_steps": steps_taken, "tokens_per_step": emitted / steps_taken,
        "spec_rows": rows, "draft_tokens": drafted, "accepted_tokens": accepted,
        "emitted_tokens": emitted, "sampling_rows": rows_out.rows, "appended_tokens": rows_out.tokens,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / rows if rows else None,
        "propose_s": proposing.seconds, "propose_calls": proposing.calls,
        "device_busy_s": sum(busy), "device_idle_s": sum(idle),
        "scheduled_tokens": sum(r["num_tokens"] for r in derived),
        "host_s": sum(r["host_total_s"] for r in derived),
        "xla_compiles_during_run": compile_count() - compiles,
        "tokens": [tokens[i] for i in range(n)],
    }


def compare_outputs(run: dict[str, Any], off_tokens: list[list[int]]) -> dict[str, Any]:
    """Which requests' greedy token ids differ from the off run's, and where they first do."""
    differ = {}
    for i, (mine, base) in enumerate(zip(run["tokens"], off_tokens)):
        if mine != base:
            differ[i] = next((j for j, (a, b) in enumerate(zip(mine, base)) if a != b), min(len(mine), len(base)))
    return {"identical_to_off": not differ, "differing_requests": {str(i): {"first_difference_at": j}
                                                                   for i, j in differ.items()}}


def check_counters(run: dict[str, Any], config: dict | None) -> None:
    """The engine's counters agree with what the requests got: each row that sampled emits one
    token plus the drafts it accepted (EOS is ignored and drafts stop short of the length
    limit, so no accepted run is cut), drafts per row are within k, accepted within drafted."""
    k = config["num_speculative_tokens"] if config else 0
    ok = run["emitted_tokens"] == run["appended_tokens"] == run["accepted_tokens"] + run["sampling_rows"] and \
        0 <= run["accepted_tokens"] <= run["draft_tokens"] <= k * run["spec_rows"] and \
        run["spec_rows"] <= run["sampling_rows"]
    if not ok:
        raise BenchmarkError(f"speculation counters disagree: emitted {run['emitted_tokens']}, sampling rows "
                             f"{run['sampling_rows']}, spec rows {run['spec_rows']}, drafted {run['draft_tokens']}, "
                             f"accepted {run['accepted_tokens']} (k={k})")


# ---- the benchmark -------------------------------------------------------------------------------
def turn_order(labels: list[str], round_: int) -> list[str]:
    return labels if round_ % 2 == 0 else labels[::-1]


def run_spec(s: SpecSettings, command: str = "", progress=print) -> dict[str, Any]:
    import jax

    configs = s.configs
    engines: dict[str, Any] = {}
    try:
        started = time.perf_counter()
        model_len = max_model_len(s, _tokenizer(s))
        for label, spec in configs.items():
            engines[label] = build_engine(s, spec, model_len)
            progress(f"engine {label}: built in {engines[label].startup_timings.get('startup_s', 0):.1f} s")
        requests = workload_requests(engines["off"], s)
        for engine in engines.values():
            warm_up(engine, requests)
        setup_s = time.perf_counter() - started
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(s.switch_interval_s)
        try:
            runs = measure(engines, configs, requests, s, progress)
        finally:
            sys.setswitchinterval(switch_interval)
        engine = engines["off"]
        engine_info = {"token_buckets": list(engine.config.token_buckets), "num_pages": engine.allocator.num_pages,
                       "attention_impl": engine.attention_impl, "dtype": engine.config.dtype,
                       "max_model_len": engine.config.max_model_len, "max_num_seqs": engine.config.max_num_seqs,
                       "async_scheduling": {label: e.config.async_scheduling for label, e in engines.items()},
                       "build_s": {label: e.startup_timings.get("startup_s") for label, e in engines.items()},
                       "jax_backend": jax.default_backend()}
    finally:
        for e in engines.values():
            e.shutdown()
    cells = summarize(runs, list(configs))
    return {
        **environment.record_header("spec", command), "settings": dataclasses.asdict(s),
        "model": s.model or "default (SmolLM2-135M-Instruct, embedded)",
        "draft_model": s.draft_model or "the target model itself (acceptance upper bound)",
        "sampling": "greedy (temperature 0), EOS ignored", "configs": configs, "engine": engine_info,
        "workloads": describe_workloads(requests, s), "setup_s": setup_s,
        "cells": cells, "runs": runs, "targets": target_verdict(cells, s),
        "greedy_outputs_identical": all(r["identical_to_off"] for r in runs),
        "xla_compiles_during_runs": sum(r["xla_compiles_during_run"] for r in runs),
    }


def measure(engines, configs, requests, s: SpecSettings, progress) -> list[dict[str, Any]]:
    """Every (workload, batch) runs every configuration by turns, `s.rounds` rounds, the order
    flipped each round; ratios to the off run of the same round, outputs compared to it (and
    off's to the first round's, which greedy decoding must repeat)."""
    labels = list(configs)
    runs, first_off = [], {}
    for round_ in range(s.rounds):
        for workload in s.workloads:
            for batch in s.batch_sizes:
                reqs = batch_requests(requests[workload], workload, batch, s)
                group = {}
                for label in turn_order(labels, round_):
                    run = timed_run(engines[label], reqs, batch, f"r{round_}-{workload}-{batch}-{label}")
                    run.update(round=round_, workload=workload, batch=batch, config=label)
                    check_counters(run, configs[label])
                    group[label] = run
                    accepted = "" if configs[label] is None else (
                        f", accepted {run['accepted_tokens']}/{run['draft_tokens']} drafts, mean acceptance length "
                        f"{_fmt(run['mean_acceptance_length'], 2)}")
                    progress(f"round {round_ + 1} {workload} batch {batch} {label}: "
                             f"{run['output_tokens_per_s']:.1f} tok/s, TPOT {_ms(run['tpot_s'])} ms, "
                             f"{run['engine_steps']} steps{accepted}")
                off = group["off"]
                first_off.setdefault((workload, batch), off["tokens"])
                for label in labels:
                    run = group[label]
                    run["throughput_ratio"] = run["output_tokens_per_s"] / off["output_tokens_per_s"]
                    run["tpot_ratio"] = (run["tpot_s"] / off["tpot_s"]) if run["tpot_s"] and off["tpot_s"] else None
                    run.update(compare_outputs(run, first_off[(workload, batch)] if label == "off" else off["tokens"]))
                    if not run["identical_to_off"]:
                        progress(f"!!! {workload} batch {batch} {label}: greedy outputs DIFFER from off: "
                                 f"{run['differing_requests']}")
                    if round_ == 0 and label == "off":
                        run["sample_output"] = engines["off"].tokenizer.decode(run["tokens"][0])
                    runs.append(run)
                progress(f"round {round_ + 1} {workload} batch {batch}, x off: " + ", ".join(
                    f"{label} {group[label]['throughput_ratio']:.2f}" for label in labels[1:]))
    for run in runs:
        del run["tokens"]
    return runs


_SUMMED = ("output_tokens_per_s", "tpot_s", "ttft_s", "throughput_ratio", "tpot_ratio", "duration_s", "engine_steps",
           "tokens_per_step", "spec_rows", "draft_tokens", "accepted_tokens", "emitted_tokens", "sampling_rows",
           "acceptance_rate", "mean_acceptance_length", "propose_s", "propose_calls", "device_busy_s", "device_idle_s",
           "scheduled_tokens", "host_s")


def summarize(runs: list[dict[str, Any]], labels: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """cells[workload][batch][config]: medians over the rounds (the counters repeat exactly
    under greedy decoding; their medians are those values), the per-round ratios, and whether
    every round's outputs were identical to off's."""
    cells: dict[str, dict[str, dict[str, Any]]] = {}
    for workload, batch in dict.fromkeys((r["workload"], r["batch"]) for r in runs):
        cell = cells.setdefault(workload, {}).setdefault(str(batch), {})
        for label in labels:
            mine = [r for r in runs if (r["workload"], r["batch"], r["config"]) == (workload, batch, label)]
            summary = {name: _median([r[name] for r in mine if r[name] is not None]) for name in _SUMMED}
            summary.update(rounds=len(mine), throughput_ratio_by_round=[r["throughput_ratio"] for r in mine],
                           identical_to_off=all(r["identical_to_off"] for r in mine),
                           num_requests=mine[0]["num_requests"], output_tokens=mine[0]["output_tokens"])
            cell[label] = summary
    return cells


def describe_workloads(requests: dict[str, list[tuple[list[int], int]]], s: SpecSettings) -> dict[str, Any]:
    out = {}
    for workload, reqs in requests.items():
        lens = [len(p) for p, _ in reqs]
        out[workload] = {
            "requests_by_batch": {str(b): len(batch_requests(reqs, workload, b, s)) for b in s.batch_sizes},
            "prompt_tokens": [min(lens), max(lens)], "output_tokens": [min(n for _, n in reqs), max(n for _, n in reqs)],
            "mean_output_tokens": statistics.mean(n for _, n in reqs)}
    if "copy" in out:
        out["copy"].update(instruction=COPY_INSTRUCTION, sentences=s.copy_sentences,
                           first_passage=passage(0, s.copy_sentences))
    if "random" in out:
        out["random"].update(scale=s.random_scale, input_range=list(scaled_range(ORCA_INPUT_RANGE, s.random_scale)),
                             output_range=list(scaled_range(ORCA_OUTPUT_RANGE, s.random_scale)),
                             arrivals=f"closed loop: at batch B, {s.random_requests_per_slot} * B requests, B in flight")
    return out


def target_verdict(cells, s: SpecSettings) -> dict[str, Any]:
    ngram = [f"ngram k={k}" for k in s.ngram_k]
    copy = cells.get("copy", {}).get("1")
    copy_verdict: dict[str, Any] = {"workload": "copy", "batch": 1, "min_throughput_ratio": TARGET_COPY_SPEEDUP}
    if copy is None or not ngram:
        copy_verdict.update(measured=False, met=None)
    else:
        by = {label: {"throughput_ratio": copy[label]["throughput_ratio"],
                      "met": copy[label]["throughput_ratio"] >= TARGET_COPY_SPEEDUP} for label in ngram}
        copy_verdict.update(measured=True, by_config=by, met=all(v["met"] for v in by.values()))
    random = cells.get("random")
    random_verdict: dict[str, Any] = {"workload": "random", "min_throughput_ratio": 1 - TARGET_RANDOM_MAX_LOSS}
    if random is None or not ngram:
        random_verdict.update(measured=False, met=None)
    else:
        by = {label: {batch: {"throughput_ratio": cell[label]["throughput_ratio"],
                              "met": cell[label]["throughput_ratio"] >= 1 - TARGET_RANDOM_MAX_LOSS}
                      for batch, cell in random.items()} for label in ngram}
        random_verdict.update(measured=True, by_config=by,
                              met=all(v["met"] for per in by.values() for v in per.values()))
    return {"copy_speedup": copy_verdict, "random_no_loss": random_verdict}


def format_report(record: dict[str, Any]) -> str:
    s = record["settings"]
    lines = [f"speculative decoding, {record['model']}: {record['sampling']}, {s['rounds']} rounds by turns, "
             f"medians; x off = ratio to the off run of the same round; draft = {record['draft_model']}"]
    lines.append("| workload | batch | config | out tok/s | x off | TPOT ms | x off | steps (proposing) | drafted | accepted | "
                 "emitted | mean acc. len | acc. rate | propose ms/step | device busy s | device idle s | "
                 "same as off |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for workload, by_batch in record["cells"].items():
        for batch, by_config in by_batch.items():
            for label, c in by_config.items():
                spec = label != "off"
                steps = f"{c['engine_steps']:.0f}" + (f" ({c['propose_calls']:.0f})" if spec else "")
                lines.append(
                    f"| {workload} | {batch} | {label} | {c['output_tokens_per_s']:.1f} | {c['throughput_ratio']:.2f} | "
                    f"{_ms(c['tpot_s'])} | {_fmt(c['tpot_ratio'], 2)} | {steps} | "
                    f"{c['draft_tokens']:.0f} | {c['accepted_tokens']:.0f} | {c['emitted_tokens']:.0f} | "
                    f"{_fmt(c['mean_acceptance_length'], 2) if spec else '-'} | "
                    f"{_fmt(c['acceptance_rate'], 2) if spec else '-'} | "
                    f"{_fmt(1e3 * c['propose_s'] / c['engine_steps'], 2) if spec else '-'} | "
                    f"{c['device_busy_s']:.1f} | {c['device_idle_s']:.1f} | "
                    f"{'yes' if c['identical_to_off'] else 'NO'} |")
    t = record["targets"]
    copy, random = t["copy_speedup"], t["random_no_loss"]
    if copy["measured"]:
        lines.append(f"target: n-gram >= {copy['min_throughput_ratio']:g}x output tok/s at batch 1 (copy): "
                     f"{'MET' if copy['met'] else 'NOT MET'} (" + ", ".join(
                         f"{label} {v['throughput_ratio']:.2f}x" for label, v in copy["by_config"].items()) + ")")
    if random["measured"]:
        lines.append(f"target: n-gram no worse than -{TARGET_RANDOM_MAX_LOSS:.0%} on the random trace: "
                     f"{'MET' if random['met'] else 'NOT MET'} (" + "; ".join(
                         f"{label} " + ", ".join(f"batch {b} {v['throughput_ratio']:.2f}x" for b, v in per.items())
                         for label, per in random["by_config"].items()) + ")")
    lines.append(f"greedy outputs identical to off: {'yes' if record['greedy_outputs_identical'] else 'NO'}")
    lines.append(f"XLA compiles during the runs: {record['xla_compiles_during_runs']}")
    return "\n".join(lines)


def _median(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f}"


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _tokenizer(s: SpecSettings):
    """The model's tokenizer, before any engine (it sizes their context); the weights of a
    converted model stay on disk until read."""
    from orca_jax.cache_dirs import default_model_cache_dir
    from orca_jax.loading.loader import load_model

    return load_model(s.model, dtype=s.dtype, cache_dir=default_model_cache_dir()).tokenizer
