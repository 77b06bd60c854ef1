"""Every feature of the engine on an accelerator against the CPU, in one bounded run.

    python benchmarks/feature_check.py --json feature_check.json            # on a GPU or TPU
    python benchmarks/feature_check.py --allow-cpu --checks kernel_float32,engine_llama   # a smoke run

Each check runs the accelerator's path and a reference and compares them with a stated
tolerance; one record per check is written to the JSON as soon as it ends, so a run cut by a time
limit keeps every check before the cut. The cheap checks come first, and each check has its own
time limit (`--check-seconds`; a SIGALRM, so a check stuck in one XLA call is reported when it
returns, and the session's stage limit is the backstop).

* kernel_*: the backend's attention kernel (pallas_gpu, pallas_tpu, or the CPU one) against the
  float64 oracle (orca_jax.kernels.testing) on ragged batches with NaN in every unowned slot:
  float32, bfloat16, float16, and int8 / fp8 KV caches; sliding windows and soft caps, and
  attention sinks where the kernel takes them. A kernel that cannot serve the shapes (the TPU one
  with an 8-bit cache) is "skipped" with its reason: the engine uses the reference there.
* engine_*: a tiny random model of each family (benchmarks/tiny_families.py) through the
  engine on the accelerator (its kernel, overlapped scheduling) and on the CPU (the reference
  attention, one step at a time): greedy tokens and top log-probabilities.
* dtype_*, quant_*, kv_*: the same with bfloat16 / float16 activations (against the float32 CPU
  run), int8 / fp8 weights and int8 / fp8 KV caches (against the CPU run of the same format).
* mxfp4: gpt-oss with its experts packed 4-bit, on both sides.
* speculation_ngram: n-gram speculative decoding against plain decoding on the accelerator.
* prefix_caching: a request that reuses another's cached pages against a CPU run without caching.
* tensor_parallel_1: the model sharded over a one-device mesh (the tensor-parallel code path).
* structured_regex: a regex-constrained output (llguidance); "skipped" where llguidance is missing.

Tokens compare under one rule: identical, or where they first differ the reference's own
log-probabilities of the two tokens are within twice the tolerance (a near-tie that a rounding
difference may flip; the sequences are not compared after it). Log-probabilities compare on
the tokens both sides list, up to and including that point.

Without an accelerator it exits with status 2, unless `--allow-cpu` (the tests): then the
"accelerator" side is the CPU too, with the CPU kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shlex
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import numpy as np

if __package__ in (None, ""):  # run as a script: benchmarks/ is importable from the checkout's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import tiny_families  # noqa: E402
from benchmarks.feature_kernels import KERNEL_CHECKS  # noqa: E402
from benchmarks.greedy_compare import compare_runs  # noqa: E402

# The engine of every check: one token bucket (each bucket is a program to compile), a pool of a
# few pages; explicit dtypes and sizes, so nothing is chosen from the default backend for the CPU side.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=32, page_size=16, num_pages=48,
              max_model_len=256, warmup=False, dtype="float32")
PROMPT_LENGTHS = (5, 23, 40)  # a decode-only row beside chunked prefills (40 > the 32-token budget)
MAX_TOKENS = 8
TOP_LOGPROBS = 3
# Every byte token once: with 1-gram lookups, whatever a random model emits next (below 259) is
# found in the history, so the n-gram proposer drafts at every decode step.
EVERY_TOKEN_PROMPT = list(range(3, 259))
REGEX = "[a-z]{3}-[0-9]{2}"
# Below this much time left, a check is not started (an engine check takes a few seconds at least).
MIN_CHECK_SECONDS = 5.0


def prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(0)
    return {f"p{n}": rng.integers(3, 259, n).tolist() for n in PROMPT_LENGTHS}


class CheckTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise CheckTimeout in this (main) thread after `seconds`."""
    def expire(signum, frame):
        raise CheckTimeout(f"over its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Runs:
    """Engines on the accelerator and on the CPU over the tiny checkpoints, each checkpoint
    written once, each CPU reference run once (several checks compare with the same one)."""

    def __init__(self, workdir: Path, accelerator, cpu):
        self.workdir, self.accelerator, self.cpu = workdir, accelerator, cpu
        self._paths: dict[str, Path] = {}
        self._references: dict[tuple, dict] = {}

    def checkpoint(self, family: str) -> Path:
        if family not in self._paths:
            self._paths[family] = tiny_families.write_family_checkpoint(self.workdir / family, family)
        return self._paths[family]

    def run(self, family: str, device, requests: dict, *, reference: bool, make_runner=None, **settings) -> dict:
        """{request id: (token ids, [{token: logprob}], num_cached_tokens)} of `requests`
        {id: (prompt, SamplingParams)} on `device`; `reference`: the reference attention, one
        step at a time (else the backend's kernel, overlapped). Requests whose id starts with
        "then" are added once the others have finished (prefix caching)."""
        from orca_jax import LLMEngine

        settings = {**ENGINE, **settings}
        settings.setdefault("kv_cache_dtype", settings["dtype"])
        if reference:
            settings.update(attention_impl="reference", async_scheduling=False)
        with jax.default_device(device), jax.default_matmul_precision("highest"):
            engine = LLMEngine(model=str(self.checkpoint(family)), make_runner=make_runner, **settings)
            results = {}
            for phase in ("first", "then"):
                for rid, (prompt, params) in requests.items():
                    if rid.startswith("then") == (phase == "then"):
                        engine.add_request(rid, prompt, params)
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            first = out.outputs[0]
                            results[out.request_id] = (list(first.token_ids), first.logprobs, out.num_cached_tokens)
            if engine.allocator.num_used:
                raise AssertionError(f"{engine.allocator.num_used} KV pages still in use after the run")
            self.last_engine = engine
        return results

    def reference(self, family: str, requests: dict, key: str, **settings) -> dict:
        """The CPU reference run of (family, key): computed once, reused."""
        if (family, key) not in self._references:
            self._references[family, key] = self.run(family, self.cpu, requests, reference=True, **settings)
        return self._references[family, key]


def greedy(max_tokens: int = MAX_TOKENS, **extra):
    from orca_jax import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=TOP_LOGPROBS, **extra)


def engine_check(family: str, tol: float, *, reference_settings: dict | None = None, **settings):
    """A check: `family` on the accelerator with `settings` against the CPU reference with
    `reference_settings` (default: the same settings)."""
    reference_settings = settings if reference_settings is None else reference_settings

    def check(runs: Runs) -> dict:
        requests = {rid: (p, greedy()) for rid, p in prompts().items()}
        key = repr(sorted(reference_settings.items()))
        want = runs.reference(family, requests, key, **reference_settings)
        got = runs.run(family, runs.accelerator, requests, reference=False, **settings)
        return {"attention_impl": runs.last_engine.attention_impl, **compare_runs(got, want, tol)}

    return check


def speculation_check(runs: Runs) -> dict:
    from orca_jax.config.speculative import SpeculativeConfig

    requests = {"every": (EVERY_TOKEN_PROMPT, greedy(24)), **{rid: (p, greedy(24)) for rid, p in prompts().items()}}
    longer = dict(max_model_len=512)
    want = runs.run("llama", runs.accelerator, requests, reference=False, **longer)
    got = runs.run("llama", runs.accelerator, requests, reference=False, **longer,
                   speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                        prompt_lookup_min=1, prompt_lookup_max=3))
    scheduler = runs.last_engine.scheduler
    result = {"draft_tokens": scheduler.num_draft_tokens, "accepted_tokens": scheduler.num_accepted_tokens,
              **compare_runs(got, want, 1e-3)}
    result["ok"] = result["ok"] and result["draft_tokens"] > 0  # speculation ran at all
    return result


def prefix_caching_check(runs: Runs) -> dict:
    shared = prompts()["p40"]
    requests = {"first": (shared, greedy()), "then": (shared[:36] + [7, 8, 9], greedy())}
    want = runs.reference("llama", requests, "no prefix caching", enable_prefix_caching=False)
    got = runs.run("llama", runs.accelerator, requests, reference=False, enable_prefix_caching=True)
    cached = got["then"][2] or 0
    result = {"cached_tokens_of_second": cached, **compare_runs(got, want, 1e-3)}
    result["ok"] = result["ok"] and cached >= 32  # two full 16-token pages reused
    return result


def one_device_mesh_runner(*args):
    """ModelRunner over a mesh of the accelerator alone: the tensor-parallel path at size 1."""
    from orca_jax.distributed import parallel
    from orca_jax.worker.runner import ModelRunner

    model_config, config, params, attention_impl, _, channel = args
    mesh = parallel.make_mesh(1, jax.local_devices()[:1])
    return ModelRunner(model_config, config, params, attention_impl, mesh, channel)


def structured_check(runs: Runs) -> dict:
    import re

    from orca_jax import StructuredOutputsParams

    constraint = StructuredOutputsParams(regex=REGEX)
    requests = {"regex": (prompts()["p23"], greedy(16, structured_outputs=constraint))}
    want = runs.reference("llama", requests, "regex")
    got = runs.run("llama", runs.accelerator, requests, reference=False)
    text = runs.last_engine.tokenizer.decode(got["regex"][0], skip_special_tokens=True)
    result = {"text": text, **compare_runs(got, want, 1e-3)}
    result["ok"] = result["ok"] and re.fullmatch(REGEX, text) is not None
    return result


def llguidance_missing() -> str | None:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return "llguidance missing (benchmarks/gpu_session.sh's header says how to carry its wheel)"
    return None


# (name, what it checks, tolerance on log-probabilities, check(runs) -> dict with "ok", skip reason or None).
# Cheap ones first: the kernels need no engine, then Llama, whose checkpoint the later checks share.
ENGINE_CHECKS = [
    ("engine_llama", "Llama (GQA, RoPE)", 1e-3, engine_check("llama", 1e-3)),
    ("dtype_bfloat16", "Llama in bfloat16 vs float32 on CPU", 0.25,
     engine_check("llama", 0.25, reference_settings={}, dtype="bfloat16")),
    ("dtype_float16", "Llama in float16 vs float32 on CPU", 0.05,
     engine_check("llama", 0.05, reference_settings={}, dtype="float16")),
    ("quant_int8", "int8 weights, both sides", 1e-2, engine_check("llama", 1e-2, quantization="int8")),
    ("quant_fp8", "fp8 weights (int8 where the device has no fp8 units), both sides", 1e-2,
     engine_check("llama", 1e-2, quantization="fp8")),
    ("kv_int8", "int8 KV cache, both sides", 5e-2, engine_check("llama", 5e-2, kv_cache_dtype="int8")),
    ("kv_fp8", "fp8_e4m3 KV cache, both sides", 5e-2, engine_check("llama", 5e-2, kv_cache_dtype="fp8_e4m3")),
    ("prefix_caching", "a second request on the first's cached pages vs CPU without caching", 1e-3,
     prefix_caching_check),
    ("speculation_ngram", "n-gram speculative decoding vs plain decoding, both on the accelerator", 1e-3,
     speculation_check),
    ("tensor_parallel_1", "the model sharded over a one-device mesh", 1e-3,
     engine_check("llama", 1e-3, reference_settings={}, make_runner=one_device_mesh_runner)),
    ("structured_regex", f"output constrained to /{REGEX}/ (llguidance)", 1e-3, structured_check),
    *[(f"engine_{family}", tiny_families.FAMILIES[family]["model_type"], 1e-3, engine_check(family, 1e-3))
      for family in ("qwen3", "gemma2", "gpt2", "qwen3_moe", "gpt_oss")],
    ("mxfp4", "gpt-oss experts packed MXFP4, both sides", 1e-3, engine_check("gpt_oss", 1e-3, quantization="mxfp4")),
]
SKIP_REASONS = {"structured_regex": llguidance_missing}


def all_checks() -> list[tuple]:
    return [*KERNEL_CHECKS, *ENGINE_CHECKS]


def run_check(name: str, what: str, tol: float, check, runs: Runs, seconds: float) -> dict:
    record = {"name": name, "what": what, "tolerance": tol}
    reason = SKIP_REASONS.get(name, lambda: None)()
    if reason:
        return {**record, "status": "skipped", "reason": reason}
    started = time.perf_counter()
    try:
        with time_limit(seconds):
            result = check(runs)
        if "skipped" in result:  # the check itself found it cannot run here (a kernel's shapes)
            record.update(status="skipped", reason=result.pop("skipped"))
        else:
            record.update(result, status="passed" if result.pop("ok") else "failed")
    except CheckTimeout as e:
        record.update(status="timed_out", error=str(e))
    except Exception as e:  # a check that crashes is a failed check; the others still run
        record.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=8))
    record["seconds"] = round(time.perf_counter() - started, 2)
    return record


def accelerator(allow_cpu: bool):
    device = jax.devices()[0]
    if device.platform == "cpu" and not allow_cpu:
        return None
    return device


def main(argv=None) -> int:
    from orca_jax.bench.environment import record_header
    from orca_jax.bench.harness import ReportFile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="feature_check.json")
    parser.add_argument("--checks", default=None, help="comma-separated names (default: all, in order)")
    parser.add_argument("--check-seconds", type=float, default=45.0, help="time limit of each check")
    parser.add_argument("--budget-seconds", type=float, default=None,
                        help="the whole run's time: checks that would start past it are skipped, not killed")
    parser.add_argument("--allow-cpu", action="store_true", help="run with the CPU as the accelerator (tests)")
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
    args = parser.parse_args(argv)
    started = time.monotonic()
    checks = all_checks()
    if args.list:
        for name, what, tol, _ in checks:
            print(f"{name:20s} tol {tol:<8g} {what}")
        return 0
    if args.checks:
        wanted = args.checks.split(",")
        unknown = sorted(set(wanted) - {c[0] for c in checks})
        if unknown:
            parser.error(f"unknown checks {unknown}; --list shows them")
        checks = [c for c in checks if c[0] in wanted]
    device = accelerator(args.allow_cpu)
    if device is None:
        print(f"feature_check: no GPU or TPU visible to JAX ({jax.devices()}); --allow-cpu runs it on the CPU",
              file=sys.stderr)
        return 2
    command = shlex.join(["python", "benchmarks/feature_check.py", *(sys.argv[1:] if argv is None else argv)])
    out = ReportFile(args.json, {**record_header("feature_check", command), "backend": device.platform,
                                 "device": device.device_kind, "checks": []})
    with tempfile.TemporaryDirectory() as tmp:
        runs = Runs(Path(tmp), device, jax.devices("cpu")[0])
        for name, what, tol, check in checks:
            left = math.inf if args.budget_seconds is None else args.budget_seconds - (time.monotonic() - started)
            if left < MIN_CHECK_SECONDS:
                record = {"name": name, "what": what, "tolerance": tol, "status": "skipped",
                          "reason": f"out of time: the run's {args.budget_seconds:.0f} s budget is spent"}
            else:
                record = run_check(name, what, tol, check, runs, min(args.check_seconds, left))
            print(f"{record['status']:9s} {name} {record.get('seconds', 0):.1f}s "
                  f"{ {k: v for k, v in record.items() if k not in ('traceback', 'what')} }", flush=True)
            out.record["checks"].append(record)
            out.save()
    failed = [r["name"] for r in out.record["checks"] if r["status"] in ("failed", "timed_out")]
    out.record["failed"] = failed
    out.save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
