"""`orca-jax bench structured`: what constrained decoding (JSON schemas) costs a batch.

One engine per batch size N (`max_num_seqs = N`), N requests at t=0, so exactly N sequences
run together; 0%, 50% and 100% of them constrained by a JSON schema, the fractions taking
turns for `rounds` rounds in one process so the machine's noise hits each alike (the order
flips every round). Every request makes exactly `output_len` tokens, greedy, EOS ignored: the
schema (an object holding an array of at least `min_items` records) cannot be complete within
`output_len` tokens, so a constrained sequence runs as long as a free one. Prompts are the
same `prompt_len` random token ids in every run, prefix caching off.

Per run: output tokens/s over the whole run; the median `engine.step()` of the decode-only
steps with all N sequences (the step period the batch sees); the host seconds per step spent
filling the grammar bitmask (`guided_decoding.fill_token_bitmask`, wrapped); and from the
engine's step timeline, where a decode step's time goes: the device's busy time (where the
masking in the step shows), its idle time waiting for the host (what the lost async overlap
costs: a constrained batch runs its steps one at a time), and the host parts. Ratios are to
the 0% run of the same round. With `sync_baseline`, a twin engine with async scheduling off
runs the 0% batch in the same turns: what the overlap a constrained batch gives up is worth
on this machine. Also: the one-off tokenizer wrap, validate and cold compile times of a few
schemas of different shapes, and the bitmask application alone on [N, V].

The target: at 64 sequences, all constrained costs at most 10% of throughput.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any

import numpy as np

from orca_jax.bench import environment
from orca_jax.bench.driver import BenchmarkError, check_pages_returned

TARGET_NUM_SEQS = 64
TARGET_MAX_COST = 0.10  # of the unconstrained batch's throughput


@dataclasses.dataclass(frozen=True)
class StructuredSettings:
    model: str | None = None
    num_seqs: tuple[int, ...] = (16, 64)
    fractions: tuple[float, ...] = (0.0, 0.5, 1.0)  # constrained share of the N requests; 0 is the baseline
    rounds: int = 3
    output_len: int = 64
    prompt_len: int = 16
    min_items: int = 1000  # records the schema asks for: far more than output_len tokens can hold
    max_num_batched_tokens: int = 256
    page_size: int = 16
    dtype: str = "float32"
    seed: int = 0
    compile_repeats: int = 3  # cold compiles per schema (a new cache key each), medians
    sync_baseline: bool = True  # also 0% on a twin engine with async_scheduling off: what the overlap is worth
    switch_interval_s: float = 1e-4  # sys.setswitchinterval while timing: the timeline stamps device finishes promptly

    def __post_init__(self):
        if not self.num_seqs or min(self.num_seqs) < 1:
            raise ValueError(f"num_seqs must be positive, got {self.num_seqs}")
        if 0.0 not in self.fractions or not all(0.0 <= f <= 1.0 for f in self.fractions):
            raise ValueError(f"fractions must lie in [0, 1] and include 0 (the baseline), got {self.fractions}")
        if max(self.num_seqs) > self.max_num_batched_tokens:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= every num_seqs")

    @property
    def max_model_len(self) -> int:
        return -(-(self.prompt_len + self.output_len) // self.page_size) * self.page_size


# ---- the schemas ---------------------------------------------------------------------------------
def records_schema(min_items: int) -> dict:
    """The benchmark's constraint: `{"records": [{"id": int, "name": str}, ...]}` with at least
    `min_items` records, so a sequence never completes it (and never stops early)."""
    record = {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
              "required": ["id", "name"], "additionalProperties": False}
    return {"type": "object", "properties": {"records": {"type": "array", "items": record, "minItems": min_items}},
            "required": ["records"], "additionalProperties": False}


def compile_schemas(min_items: int) -> dict[str, dict]:
    """Schemas of different shapes, for the compile times."""
    flat = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]}, "tags": {"type": "array", "items": {"type": "boolean"}}},
        "required": ["name", "age", "pet"], "additionalProperties": False}
    nested: dict = {"type": "integer"}
    for level in range(4, 0, -1):
        nested = {"type": "object", "properties": {f"level{level}": nested, "label": {"type": "string"}},
                  "required": [f"level{level}", "label"], "additionalProperties": False}
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
             {"enum": ["red", "green", "blue"]}]
    wide = {"type": "object", "properties": {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(40)},
            "required": [f"field_{i:02d}" for i in range(40)], "additionalProperties": False}
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["value"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
    patterns = {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "when": {"type": "string", "format": "date-time"},
        "contact": {"anyOf": [{"type": "string", "format": "email"},
                              {"type": "object", "properties": {"phone": {"type": "string", "pattern": r"^\+[0-9]{6,12}$"}},
                               "required": ["phone"], "additionalProperties": False}]},
        "amount": {"type": "number", "minimum": 0, "maximum": 1e6}},
        "required": ["code", "when", "contact", "amount"], "additionalProperties": False}
    return {"flat object": flat, "records array (the benchmark's)": records_schema(min_items),
            "nested 4 deep": nested, "wide (40 fields)": wide, "recursive tree ($ref)": tree,
            "patterns, formats, anyOf": patterns}


# ---- checking the outputs ------------------------------------------------------------------------
_NUMBER_CHARS = set("+-0123456789.eE")
_LITERALS = ("true", "false", "null")


def json_prefix_error(text: str) -> str | None:
    """None if `text` is the beginning of some JSON document (whitespace between tokens
    allowed), else what is wrong and where. Independent of llguidance: a small pushdown scan."""
    import re

    number = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?\Z")
    stack: list[str] = []  # open containers, "{" or "["
    expect = "value"  # value | key | colon | after (a value ended) | key_or_close | value_or_close
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t\n\r":
            i += 1
            continue
        if expect == "after":
            if not stack:
                return f"text after the document at {i}"
            if c == ",":
                expect = "key" if stack[-1] == "{" else "value"
            elif c == "}]"[stack[-1] == "["]:
                stack.pop()
            else:
                return f"{c!r} at {i} after a value"
            i += 1
        elif expect == "colon":
            if c != ":":
                return f"{c!r} at {i}, expected ':'"
            expect, i = "value", i + 1
        elif expect in ("key", "key_or_close"):
            if c == "}" and expect == "key_or_close":
                stack.pop()
                expect, i = "after", i + 1
            elif c == '"':
                i, error = _string_end(text, i)
                expect = "colon"
                if error:
                    return error
            else:
                return f"{c!r} at {i}, expected a key"
        else:  # a value, or the end of an empty array
            if c == "]" and expect == "value_or_close":
                stack.pop()
                expect, i = "after", i + 1
            elif c in "{[":
                stack.append(c)
                expect, i = ("key_or_close" if c == "{" else "value_or_close"), i + 1
            elif c == '"':
                i, error = _string_end(text, i)
                expect = "after"
                if error:
                    return error
            elif c in _NUMBER_CHARS:
                j = i
                while j < n and text[j] in _NUMBER_CHARS:
                    j += 1
                run = text[i:j]
                if not (number.match(run) or (j == n and number.match(run + "0"))):
                    return f"bad number {run!r} at {i}"
                expect, i = "after", j
            else:
                literal = next((w for w in _LITERALS if w[0] == c), None)
                chunk = text[i:i + len(literal)] if literal else ""
                if literal is None or not literal.startswith(chunk):
                    return f"{c!r} at {i}, expected a value"
                expect, i = "after", i + len(chunk)  # a literal cut short ends the text
    return None


def _string_end(text: str, start: int) -> tuple[int, str | None]:
    """Index after the JSON string opening at `start` (len(text) if it runs to the end), and an
    error if it holds what JSON forbids."""
    i, n = start + 1, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            return i + 1, None
        if c == "\\":
            escape = text[i + 1:i + 2]
            if escape and escape not in '"\\/bfnrtu':
                return i, f"bad escape at {i}"
            if escape == "u":
                digits = text[i + 2:i + 6]
                if not all(d in "0123456789abcdefABCDEF" for d in digits):
                    return i, f"bad \\u escape at {i}"
                i += 6
                continue
            i += 2
            continue
        if ord(c) < 0x20:
            return i, f"control character {c!r} in a string at {i}"
        i += 1
    return n, None


# ---- measuring -----------------------------------------------------------------------------------
class FillTimer:
    """Host seconds of each `fill_token_bitmask` call (the step's grammar masks), while entered.
    `step_token_bitmask` looks the function up in its module at every call, so wrapping the
    module's attribute sees every step."""

    def __init__(self):
        self.seconds: list[float] = []

    def __enter__(self):
        from orca_jax.structured import guided_decoding

        real = guided_decoding.fill_token_bitmask

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - started)

        self._real, guided_decoding.fill_token_bitmask = real, timed
        return self

    def __exit__(self, *exc):
        from orca_jax.structured import guided_decoding

        guided_decoding.fill_token_bitmask = self._real


def random_prompts(num: int, length: int, vocab_size: int, exclude_ids, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(exclude_ids), dtype=np.int64))
    return [rng.choice(allowed, size=length).tolist() for _ in range(num)]


def request_params(constrained: bool, s: StructuredSettings):
    from orca_jax.core.sampling_params import SamplingParams
    from orca_jax.structured.structured_outputs import StructuredOutputsParams

    constraint = StructuredOutputsParams(json=records_schema(s.min_items)) if constrained else None
    return SamplingParams(max_tokens=s.output_len, ignore_eos=True, temperature=0.0, structured_outputs=constraint)


def build_engine(s: StructuredSettings, num_seqs: int, async_scheduling: bool = True):
    from orca_jax.engine.engine import LLMEngine

    return LLMEngine(model=s.model, dtype=s.dtype, max_num_seqs=num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                     page_size=s.page_size, max_model_len=s.max_model_len, seed=s.seed, enable_prefix_caching=False,
                     num_pages=num_seqs * (s.max_model_len // s.page_size) + 1, async_scheduling=async_scheduling)


def warm_up(engine, prompt: list[int], s: StructuredSettings) -> None:
    """A free and a constrained request through every host path: the grammar compiler's
    tokenizer wrap and the benchmark schema's compile, llguidance's mask thread pool, the
    detokenizer. The engine compiled its step programs when it was built."""
    short = dataclasses.replace(s, output_len=2)
    engine.add_request("warmup-free", prompt, request_params(False, short))
    engine.add_request("warmup-constrained", prompt, request_params(True, short))
    while engine.has_unfinished_requests():
        engine.step()


def timed_run(engine, prompts: list[list[int]], num_constrained: int, s: StructuredSettings, tag: str) -> dict[str, Any]:
    """All prompts at t=0, the first `num_constrained` under the schema; throughput, decode
    step times and their breakdown, mask fill times, and the outputs checked."""
    from orca_jax.worker.compile_guard import compile_count
    from orca_jax.engine.step_timing import derive

    num_seqs = len(prompts)
    compiles, steps = compile_count(), engine.num_steps
    finished: dict[int, Any] = {}
    step_walls: list[float] = []
    timeline = engine.timeline
    timeline.clear()
    timeline.enable()
    try:
        with FillTimer() as fills:
            started = time.perf_counter()
            engine.add_requests([(f"{tag}-{i}", prompt, request_params(i < num_constrained, s))
                                 for i, prompt in enumerate(prompts)])
            while engine.has_unfinished_requests():
                running = engine.scheduler.running
                decoding = len(running) == num_seqs and all(seq.is_decoding for seq in running)
                step_started = time.perf_counter()
                outputs = engine.step()
                if decoding:
                    step_walls.append(time.perf_counter() - step_started)
                for out in outputs:
                    if out.error is not None:
                        raise BenchmarkError(f"request {out.request_id} failed: {out.error}")
                    if out.finished:
                        finished[int(out.request_id.rsplit("-", 1)[1])] = out
            duration = time.perf_counter() - started
        timeline.wait_idle()
        records = list(timeline.records)
    finally:
        timeline.disable()
        timeline.clear()
    check_pages_returned(engine)
    full_decode = [r for r in derive(records)[1:] if not r["has_prefill"] and r["num_seqs"] == num_seqs]
    return {
        "num_seqs": num_seqs, "num_constrained": num_constrained, "duration_s": duration,
        "output_tokens": num_seqs * s.output_len, "output_tokens_per_s": num_seqs * s.output_len / duration,
        "engine_steps": engine.num_steps - steps,
        "decode_steps_timed": len(step_walls), "median_decode_step_s": _median(step_walls),
        "mask_fills": len(fills.seconds), "median_mask_fill_s": _median(fills.seconds),
        "mask_fill_s_total": sum(fills.seconds),
        "decode_step_parts": step_parts(full_decode),
        **check_outputs(finished, num_seqs, num_constrained, s.output_len),
        "xla_compiles_during_run": compile_count() - compiles,
        "load_average": list(_load_average()),
    }


def step_parts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the full decode-only steps of the timeline: the device's busy and idle time
    per step and the host parts (build holds the mask fill, postprocess the matchers' advance)."""
    names = ("period_s", "device_step_s", "device_idle_s", "host_total_s", "schedule_s", "build_s",
             "dispatch_s", "postprocess_s", "detokenize_s", "outputs_s")
    parts: dict[str, Any] = {"steps": len(rows)}
    for name in names:
        values = [r[name] for r in rows if r[name] == r[name]]  # NaN: the watcher missed it
        parts[name] = _median(values)
    return parts


def check_outputs(finished: dict[int, Any], num_seqs: int, num_constrained: int, output_len: int) -> dict[str, Any]:
    """Every request finished on its length with exactly `output_len` tokens (else the run is
    void); constrained outputs must read as the start of a JSON document."""
    if sorted(finished) != list(range(num_seqs)):
        raise BenchmarkError(f"{num_seqs - len(finished)} requests did not finish")
    for i, out in finished.items():
        got, reason = len(out.outputs[0].token_ids), out.outputs[0].finish_reason
        if got != output_len or reason != "length":
            raise BenchmarkError(f"request {i} ({'constrained' if i < num_constrained else 'free'}) made {got} "
                                 f"tokens ({reason!r}), expected {output_len} (length)")
    errors = {i: e for i in range(num_constrained) if (e := json_prefix_error(finished[i].outputs[0].text))}
    return {"constrained_invalid_json_prefixes": len(errors),
            "json_prefix_errors": [f"request {i}: {e}" for i, e in list(errors.items())[:3]],
            "sample_constrained_output": finished[0].outputs[0].text if num_constrained else None,
            "sample_free_output": finished[num_seqs - 1].outputs[0].text if num_constrained < num_seqs else None}


def grammar_compile_times(engine, s: StructuredSettings) -> dict[str, Any]:
    """The one-off tokenizer wrap, then per schema the medians of `compile_repeats` cold
    validates and compiles (each a new cache key: a title that llguidance ignores)."""
    from orca_jax.structured.structured_outputs import StructuredOutputsParams

    started = time.perf_counter()
    engine.grammars.llg_tokenizer()
    wrap_s = time.perf_counter() - started
    schemas = {}
    for name, schema in compile_schemas(s.min_items).items():
        validate, compile_ = [], []
        for repeat in range(s.compile_repeats):
            params = StructuredOutputsParams(json={"title": f"cold compile {repeat}", **schema})
            started = time.perf_counter()
            text = engine.grammars.validate(params)
            validate.append(time.perf_counter() - started)
            started = time.perf_counter()
            engine.grammars.compile(params).result()
            compile_.append(time.perf_counter() - started)
        schemas[name] = {"validate_s": _median(validate), "compile_s": _median(compile_),
                         "grammar_chars": len(text), "validate_all_s": validate, "compile_all_s": compile_}
    return {"tokenizer_wrap_s": wrap_s, "vocab_size": engine.model_config.vocab_size, "schemas": schemas}


def masking_alone(num_seqs: int, vocab_size: int, repeats: int = 20) -> dict[str, float]:
    """The sampler's bitmask application (`sampling.apply_token_bitmask`) jitted alone on
    f32[N, V] logits, every row guided, against copying the logits: an upper bound of what the
    masking adds to a step (in the step XLA may fuse it with what follows)."""
    import jax
    import jax.numpy as jnp

    from orca_jax.structured.guided_decoding import bitmask_words
    from orca_jax.worker.sampling import apply_token_bitmask

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((num_seqs, vocab_size), np.float32))
    bitmask = jnp.asarray(rng.integers(-2**31, 2**31, (num_seqs, bitmask_words(vocab_size)), dtype=np.int64)
                          .astype(np.int32))
    guided = jnp.ones(num_seqs, bool)
    masked, copied = jax.jit(apply_token_bitmask), jax.jit(lambda x: x + 0.0)
    calls = {"apply_token_bitmask_s": lambda: masked(logits, bitmask, guided), "copy_s": lambda: copied(logits)}
    for call in calls.values():
        call().block_until_ready()  # compile
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):  # by turns
        for name, call in calls.items():
            started = time.perf_counter()
            call().block_until_ready()
            seconds[name].append(time.perf_counter() - started)
    return {name: _median(values) for name, values in seconds.items()}


# ---- the benchmark -------------------------------------------------------------------------------
def variant_label(scheduling: str, fraction: float) -> str:
    return f"{fraction:g}" if scheduling == "async" else f"{fraction:g} {scheduling}"


def turn_order(s: StructuredSettings, round_: int) -> list[tuple[str, float]]:
    """The (scheduling, fraction) runs of a round, in the order they run: the fractions on the
    async engine, then the sync engine's 0%; flipped every other round."""
    turns = [("async", f) for f in sorted(s.fractions)] + ([("sync", 0.0)] if s.sync_baseline else [])
    return turns if round_ % 2 == 0 else turns[::-1]


def run_batch_size(s: StructuredSettings, num_seqs: int, progress, compile_times: bool) -> dict[str, Any]:
    """An engine at max_num_seqs = num_seqs (and its sync twin), every variant by turns for
    s.rounds rounds."""
    engines = {"async": build_engine(s, num_seqs)}
    try:
        if s.sync_baseline:
            engines["sync"] = build_engine(s, num_seqs, async_scheduling=False)
        engine = engines["async"]
        special = tuple(getattr(engine.tokenizer, "all_special_ids", ()) or ())
        prompts = random_prompts(num_seqs, s.prompt_len, engine.model_config.vocab_size, special, s.seed)
        result: dict[str, Any] = {"engine": {
            "token_buckets": list(engine.config.token_buckets), "num_pages": engine.allocator.num_pages,
            "attention_impl": engine.attention_impl, "dtype": engine.config.dtype,
            "async_scheduling": engine.config.async_scheduling, "max_model_len": engine.config.max_model_len,
            "build_s": {name: e.startup_timings.get("startup_s") for name, e in engines.items()}}}
        if compile_times:
            result["grammar_compile"] = grammar_compile_times(engine, s)
        for e in engines.values():
            warm_up(e, prompts[0], s)
        runs = []
        for round_ in range(s.rounds):
            for scheduling, fraction in turn_order(s, round_):
                run = timed_run(engines[scheduling], prompts, round(fraction * num_seqs), s,
                                f"r{round_}-{scheduling}-{fraction:g}")
                run.update(round=round_, fraction=fraction, scheduling=scheduling)
                runs.append(run)
                progress(f"N={num_seqs} round {round_ + 1} {fraction:.0%} constrained ({scheduling}): "
                         f"{run['output_tokens_per_s']:.1f} tok/s, decode step "
                         f"{1e3 * run['median_decode_step_s']:.0f} ms, mask fill "
                         f"{1e3 * (run['median_mask_fill_s'] or 0):.2f} ms")
        add_ratios(runs)
        result["runs"] = runs
        result["by_variant"] = summarize_variants(runs)
        result["masking_alone"] = masking_alone(num_seqs, engine.model_config.vocab_size)
        result["accounted_cost_all_constrained"] = accounted_cost(result)
        return result
    finally:
        for e in engines.values():
            e.shutdown()


def add_ratios(runs: list[dict[str, Any]]) -> None:
    """Each run's throughput and decode step against the async 0% run of its round."""
    baseline = {r["round"]: r for r in runs if r["fraction"] == 0.0 and r["scheduling"] == "async"}
    for r in runs:
        base = baseline[r["round"]]
        r["throughput_ratio"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        r["decode_step_ratio"] = r["median_decode_step_s"] / base["median_decode_step_s"]


def summarize_variants(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per (scheduling, fraction), in the order of the first round, medians over the rounds."""
    summary = {}
    for scheduling, fraction in dict.fromkeys((r["scheduling"], r["fraction"]) for r in runs if r["round"] == 0):
        mine = [r for r in runs if (r["scheduling"], r["fraction"]) == (scheduling, fraction)]
        parts = {name: _median([r["decode_step_parts"][name] for r in mine if r["decode_step_parts"][name] is not None])
                 for name in mine[0]["decode_step_parts"] if name != "steps"}
        summary[variant_label(scheduling, fraction)] = {
            "fraction": fraction, "scheduling": scheduling, "rounds": len(mine),
            "output_tokens_per_s": _median([r["output_tokens_per_s"] for r in mine]),
            "median_decode_step_s": _median([r["median_decode_step_s"] for r in mine]),
            "median_mask_fill_s": _median([r["median_mask_fill_s"] for r in mine if r["median_mask_fill_s"] is not None]),
            "throughput_ratio": _median([r["throughput_ratio"] for r in mine]),
            "decode_step_ratio": _median([r["decode_step_ratio"] for r in mine]),
            "decode_step_parts": parts,
        }
    return summary


def accounted_cost(cell: dict[str, Any]) -> float | None:
    """What the step timeline attributes to constraining every row, as a share of the free
    batch's decode step: the device's extra idle time waiting for the host (the lost overlap,
    the mask fill included) plus the bitmask application measured alone. Unlike the throughput
    ratio, it does not carry the machine's run-to-run noise; it leaves out any slowdown of the
    rest of the step program."""
    free, guided = cell["by_variant"].get("0"), cell["by_variant"].get("1")
    if free is None or guided is None or free["decode_step_parts"]["period_s"] is None:
        return None
    idle = (guided["decode_step_parts"]["device_idle_s"] or 0.0) - (free["decode_step_parts"]["device_idle_s"] or 0.0)
    return (idle + cell["masking_alone"]["apply_token_bitmask_s"]) / free["decode_step_parts"]["period_s"]


def target_verdict(by_num_seqs: dict[str, Any]) -> dict[str, Any]:
    verdict: dict[str, Any] = {"num_seqs": TARGET_NUM_SEQS, "fraction": 1.0, "max_cost": TARGET_MAX_COST}
    cell = by_num_seqs.get(str(TARGET_NUM_SEQS), {}).get("by_variant", {}).get("1")
    if cell is None:
        return {**verdict, "measured": False, "met": None}
    cost = 1.0 - cell["throughput_ratio"]
    return {**verdict, "measured": True, "throughput_ratio": cell["throughput_ratio"], "cost": cost,
            "met": cost <= TARGET_MAX_COST,
            "accounted_cost": by_num_seqs[str(TARGET_NUM_SEQS)]["accounted_cost_all_constrained"]}


def run_structured(s: StructuredSettings, command: str = "", progress=print) -> dict[str, Any]:
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(s.switch_interval_s)
    try:
        by_num_seqs = {}
        for i, num_seqs in enumerate(s.num_seqs):
            by_num_seqs[str(num_seqs)] = run_batch_size(s, num_seqs, progress, compile_times=i == 0)
    finally:
        sys.setswitchinterval(switch_interval)
    first = by_num_seqs[str(s.num_seqs[0])]
    runs = [r for cell in by_num_seqs.values() for r in cell["runs"]]
    return {
        **environment.record_header("structured", command), "settings": dataclasses.asdict(s),
        "model": s.model or "default (SmolLM2-135M-Instruct, embedded)",
        "sampling": "greedy (temperature 0), EOS ignored", "schema": records_schema(s.min_items),
        "grammar_compile": first.pop("grammar_compile"),
        "by_num_seqs": by_num_seqs, "target": target_verdict(by_num_seqs),
        "xla_compiles_during_runs": sum(r["xla_compiles_during_run"] for r in runs),
        "constrained_invalid_json_prefixes": sum(r["constrained_invalid_json_prefixes"] for r in runs),
    }


def format_report(record: dict[str, Any]) -> str:
    s = record["settings"]
    lines = [f"structured outputs, {record['model']}: N requests at t=0, {s['output_len']} output tokens each "
             f"({record['sampling']}), {s['rounds']} rounds by turns, medians; ratios to 0% of the same round"]
    lines.append("| N | constrained | out tok/s | x 0% | decode step ms | x 0% | mask fill ms/step | "
                 "device busy ms | device idle ms | host ms |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for num_seqs, cell in record["by_num_seqs"].items():
        for f in sorted(cell["by_variant"].values(), key=lambda v: (v["scheduling"], v["fraction"])):
            p = f["decode_step_parts"]
            label = f"{f['fraction']:.0%}" + ("" if f["scheduling"] == "async" else f" ({f['scheduling']} engine)")
            lines.append(f"| {num_seqs} | {label} | {f['output_tokens_per_s']:.1f} | "
                         f"{f['throughput_ratio']:.3f} | {1e3 * f['median_decode_step_s']:.0f} | "
                         f"{f['decode_step_ratio']:.3f} | {_ms(f['median_mask_fill_s'], 2)} | "
                         f"{_ms(p['device_step_s'])} | {_ms(p['device_idle_s'])} | {_ms(p['host_total_s'])} |")
    for num_seqs, cell in record["by_num_seqs"].items():
        m = cell["masking_alone"]
        lines.append(f"N={num_seqs}: bitmask applied alone on [N, V] {1e3 * m['apply_token_bitmask_s']:.2f} ms "
                     f"(a copy of the logits: {1e3 * m['copy_s']:.2f} ms)")
        if (accounted := cell.get("accounted_cost_all_constrained")) is not None:
            lines.append(f"N={num_seqs}, all constrained, accounted from the timeline (extra device idle + "
                         f"masking alone, over the free step): {100 * accounted:.1f}%")
    g = record["grammar_compile"]
    lines.append(f"grammar compile (vocabulary {g['vocab_size']}): tokenizer wrap {g['tokenizer_wrap_s']:.2f} s once")
    lines.append("| schema | validate ms | compile ms | grammar chars |")
    lines.append("|---|---|---|---|")
    for name, c in g["schemas"].items():
        lines.append(f"| {name} | {1e3 * c['validate_s']:.1f} | {1e3 * c['compile_s']:.1f} | {c['grammar_chars']} |")
    t = record["target"]
    if t["measured"]:
        lines.append(f"target: {t['num_seqs']} sequences all constrained cost <= {t['max_cost']:.0%} of throughput: "
                     f"{'MET' if t['met'] else 'NOT MET'} (cost {100 * t['cost']:.1f}%, ratio {t['throughput_ratio']:.3f}; "
                     f"accounted from the timeline {100 * t['accounted_cost']:.1f}%)")
    else:
        lines.append(f"target ({t['num_seqs']} sequences all constrained): not measured in this run")
    lines.append(f"constrained outputs that are not a JSON prefix: {record['constrained_invalid_json_prefixes']}")
    lines.append(f"XLA compiles during the runs: {record['xla_compiles_during_runs']}")
    return "\n".join(lines)


def _median(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def _ms(seconds: float | None, digits: int = 0) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.{digits}f}"


def _load_average() -> tuple[float, ...]:
    import os

    try:
        return os.getloadavg()
    except OSError:
        return ()
