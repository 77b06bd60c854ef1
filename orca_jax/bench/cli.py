"""`orca-jax bench orca | offline | serve | simulate | startup | host | prefix | structured | spec | quant`: argument
parsing and output files.

Every subcommand prints its table, writes a JSON record (and a figure where there are curves)
and records the exact command, machine and date inside the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates must be comma-separated numbers, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive, got {text!r}")
    return rates


def _names(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _omp_bind(text: str) -> str:
    from orca_jax.bench.vllm_peer import valid_omp_bind

    try:
        return valid_omp_bind(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


# Results go here unless --json/--plot say otherwise: never into docs/, whose files are the
# committed, quoted results (docs/benchmarks.md names the commands that wrote them there).
RESULTS_DIR = "bench-results"


def write_json(record: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"wrote {path}")


# ---- bench orca -------------------------------------------------------------------------------------
def cmd_orca(args) -> int:
    from orca_jax.bench.environment import command_from_args
    from orca_jax.bench.orca import SweepSettings, format_report, run_sweep
    from orca_jax.bench.plots import plot_curves

    settings = SweepSettings(
        model=args.model, scale=args.scale, num_requests=args.num_requests, rates=args.rates,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=args.page_size, num_pages=args.num_pages, dtype=args.dtype, seed=args.seed,
        slo_ms_per_token=args.slo_ms_per_token, policies=args.policies, request_returns=args.request_returns,
        pipeline_parallel_size=args.pipeline_parallel_size, tensor_parallel_size=args.tensor_parallel_size)
    record = run_sweep(settings, command_from_args("orca", args), progress=lambda line: print(line, flush=True))
    print(format_report(record))
    write_json(record, args.json)
    if args.plot:
        title = (f"orca_jax, {Path(record['model']).name} ({record['machine']['jax_backend']})\n"
                 f"Orca's trace at length scale {args.scale}, max_num_seqs {args.max_num_seqs}, "
                 f"{args.num_requests} requests per rate")
        if plot_curves(record["curves"], args.plot, title=title, slo_ms_per_token=record.get("slo_ms_per_token")):
            print(f"wrote {args.plot}")
    return 0


def _add_request_returns(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-returns", choices=("batch", "early"), default="batch",
                   help="request-level responses: 'batch' return together when their static batch ends "
                        "(FasterTransformer, Orca's baseline; default) or 'early', each when it finishes")


def _add_orca_parser(sub) -> None:
    p = sub.add_parser("orca", help="Orca's experiment in-process: both scheduling policies over arrival rates")
    p.add_argument("--model", default=None, help="HF directory, .gguf file or hub id (default: the embedded SmolLM2)")
    p.add_argument("--scale", type=_positive_float, default=0.25,
                   help="length scale: input U[32, 512] and output U[1, 128] times this (default 0.25)")
    p.add_argument("--num-requests", type=_positive_int, default=48, help="requests per rate (default 48)")
    p.add_argument("--rates", type=_rates, default=(0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0),
                   help="comma-separated arrival rates, requests/s")
    p.add_argument("--max-num-seqs", type=_positive_int, default=16, help="max batch size, both policies")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=256, help="token budget per step (default 256)")
    p.add_argument("--page-size", type=_positive_int, default=16, help="tokens per KV page (default 16)")
    p.add_argument("--num-pages", type=_positive_int, default=None,
                   help="KV pool, both policies (default: max_num_seqs full-length sequences)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="engine dtype (default float32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace (arrivals, lengths, prompts)")
    p.add_argument("--slo-ms-per-token", type=_positive_float, default=None,
                   help="latency of the headline ratio (default: 2x the unloaded iteration-level latency)")
    p.add_argument("--policies", type=_names, default=("iteration", "request"),
                   help="comma-separated scheduling policies to compare: iteration, request, request_padded "
                        "(FasterTransformer's padded rectangles) (default iteration,request)")
    p.add_argument("--pipeline-parallel-size", type=_positive_int, default=1,
                   help="pipeline stages, every policy (on CPU force devices first: XLA_FLAGS="
                        "--xla_force_host_platform_device_count=N) (default 1)")
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1, help="devices per stage (default 1)")
    _add_request_returns(p)
    p.add_argument("--json", default=f"{RESULTS_DIR}/orca_cpu.json", help="output JSON ('' for none)")
    p.add_argument("--plot", default=f"{RESULTS_DIR}/orca_cpu.png", help="output figure ('' for none)")
    p.set_defaults(func=cmd_orca)


# ---- bench offline ---------------------------------------------------------------------------------
def cmd_offline(args) -> int:
    from orca_jax.bench.environment import command_from_args
    from orca_jax.bench.offline import OfflineSettings, format_report, run_offline

    settings = OfflineSettings(
        model=args.model, num_requests=args.num_requests, scale=args.scale, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype, max_model_len=args.max_model_len,
        page_size=args.page_size, peers=() if args.skip_peers else args.peers, seed=args.seed,
        torch_threads=args.torch_threads, torch_device=args.torch_device, matmul_size=args.matmul_size,
        matmul_repeats=args.matmul_repeats, async_scheduling=args.async_scheduling, vllm_python=args.vllm_python,
        vllm_omp_bind=args.vllm_omp_bind, vllm_timeout_s=args.vllm_timeout)
    record = run_offline(settings, command_from_args("offline", args))
    print(format_report(record))
    write_json(record, args.json)
    return 0


def add_offline_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `bench offline`."""
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--num-requests", type=_positive_int, default=48, help="requests, all arriving at t=0 (default 48)")
    p.add_argument("--scale", type=_positive_float, default=0.5,
                   help="length scale (0.5: input U[16, 256], output U[1, 64]); 1.0 is Orca's trace")
    p.add_argument("--max-num-seqs", type=_positive_int, default=16,
                   help="orca_jax max_num_seqs; also the static batch size and the continuous peer's batch")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=256,
                   help="orca_jax token budget per step; also the continuous peer's max_batch_tokens")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="orca_jax dtype (the transformers peers always run float32)")
    p.add_argument("--max-model-len", type=_positive_int, default=None, help="orca_jax max_model_len (default: the model's)")
    p.add_argument("--page-size", type=_positive_int, default=16, help="orca_jax tokens per KV page (default 16)")
    p.add_argument("--async-scheduling", default=True, action=argparse.BooleanOptionalAction,
                   help="orca_jax overlaps the host's work with the device's (default: on)")
    p.add_argument("--peers", type=_names, default=("static", "continuous"),
                   help="comma-separated peers, run in this order after orca_jax: static (transformers' generate), "
                        "continuous (transformers' continuous batching), vllm (vLLM's CPU build, its default "
                        "OpenMP threads), vllm_bind (vLLM with its OpenMP threads bound to --vllm-omp-bind) "
                        "(default static,continuous)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="the Python of vLLM's own environment (default: $ORCA_JAX_VLLM_PYTHON, else this Python "
                        "if it imports vllm, else the environment of a `vllm` command on PATH; none found: "
                        "the vllm peers are skipped)")
    p.add_argument("--vllm-omp-bind", type=_omp_bind, default=None, metavar="CPUS",
                   help="VLLM_CPU_OMP_THREADS_BIND of the vllm_bind peer, e.g. 0-1 (default: every core "
                        "this process may run on)")
    p.add_argument("--vllm-timeout", type=_positive_float, default=1800.0,
                   help="seconds per vLLM peer: engine start, warm-up and run (default 1800)")
    p.add_argument("--skip-peers", action="store_true", help="run orca_jax only (no torch needed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the requests")
    p.add_argument("--torch-threads", type=_positive_int, default=os.cpu_count() or 1,
                   help="torch threads of the peers (default: all cores)")
    p.add_argument("--torch-device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1, ...")
    p.add_argument("--matmul-size", type=_positive_int, default=2048, help="square matmul for the roofline rate")
    p.add_argument("--matmul-repeats", type=_positive_int, default=5, help="timed matmuls for the roofline rate")
    p.add_argument("--json", default=None, help="write every number here as JSON")


def _add_offline_parser(sub) -> None:
    p = sub.add_parser("offline", help="all requests at t=0: orca_jax vs transformers' static and continuous "
                                       "batching (and vLLM's CPU build, --peers vllm)")
    add_offline_arguments(p)
    p.set_defaults(func=cmd_offline)


# ---- bench serve -----------------------------------------------------------------------------------
def cmd_serve(args) -> int:
    import asyncio

    from orca_jax.bench.environment import now_utc
    from orca_jax.bench.serve_client import ServeTarget, format_report, replay
    from orca_jax.bench.trace import make_trace

    target = ServeTarget(args.base_url.rstrip("/"), args.served_model, args.api_key, args.timeout,
                         args.max_concurrency)
    vocab = _prompt_vocabulary(args, target)
    print(f"prompt token ids: {vocab.size} ({len(vocab.excluded)} excluded), from {vocab.source}")
    trace = make_trace(args.num_requests, args.scale, args.seed, vocab_size=vocab.size, exclude_ids=vocab.excluded,
                       rate=args.rate)
    started = now_utc()
    record = asyncio.run(replay(trace, target, show_progress=not args.no_progress))
    record = {"benchmark": "serve", "date": started, "command": _serve_command(args),
              "target": {k: v for k, v in vars(target).items() if k != "api_key"}, "trace": trace.describe(), **record}
    print(format_report(record))
    write_json(record, args.json)
    return 0 if record["failed"] == 0 else 1


def _prompt_vocabulary(args, target):
    """--tokenizer, else --vocab-size, else whatever the server says of its model."""
    from orca_jax.bench.serve_client import PromptVocabulary, served_vocabulary, vocabulary_from_tokenizer

    if args.tokenizer:
        return vocabulary_from_tokenizer(args.tokenizer, f"--tokenizer {args.tokenizer}")
    if args.vocab_size:
        excluded = tuple(range(min(args.min_token_id, args.vocab_size - 1)))
        return PromptVocabulary(args.vocab_size, excluded, f"--vocab-size {args.vocab_size}")
    return served_vocabulary(target)


def _serve_command(args) -> str:
    from orca_jax.bench.environment import command_from_args

    return command_from_args("serve", args, skip=("api_key",))


def _add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="replay the trace over HTTP against an OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--served-model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key (default: $OPENAI_API_KEY)")
    p.add_argument("--rate", type=_positive_float, default=None, help="Poisson arrival rate, req/s (default: all at once)")
    p.add_argument("--num-requests", type=_positive_int, default=100, help="requests to send (default 100)")
    p.add_argument("--scale", type=_positive_float, default=1.0, help="length scale of Orca's trace")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace")
    p.add_argument("--tokenizer", default=None,
                   help="the served model's tokenizer, for its vocabulary and special ids (default: ask the server)")
    p.add_argument("--vocab-size", type=_positive_int, default=None,
                   help="prompt ids below this, instead of asking the server for its vocabulary")
    p.add_argument("--min-token-id", type=int, default=256,
                   help="with --vocab-size: prompt ids at or above this, away from special tokens")
    p.add_argument("--max-concurrency", type=_positive_int, default=None, help="requests in flight at most (default: no cap)")
    p.add_argument("--timeout", type=_positive_float, default=600.0, help="per request, seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", default=None, help="write every number here as JSON")
    p.set_defaults(func=cmd_serve)


# ---- bench simulate --------------------------------------------------------------------------------
def cmd_simulate(args) -> int:
    from orca_jax.bench.cost_model import load_cost_model
    from orca_jax.bench.environment import command_from_args
    from orca_jax.bench.plots import plot_curves
    from orca_jax.bench.simulate import format_report, run_simulation

    cost = load_cost_model(args.cost_model)
    if args.batches_in_flight is None:  # spelled out in the record's command
        args.batches_in_flight = cost.num_stages
    elif args.batches_in_flight > cost.num_stages:
        raise SystemExit(f"--batches-in-flight: at most one per pipeline stage ({cost.num_stages} in {cost.name}), "
                         f"got {args.batches_in_flight}")
    record = run_simulation(cost, rates=args.rates, num_requests=args.num_requests, scale=args.scale, seed=args.seed,
                            slo_ms_per_token=args.slo_ms_per_token, num_pages=args.num_pages,
                            request_returns=args.request_returns, batches_in_flight=args.batches_in_flight,
                            command=command_from_args("simulate", args),
                            progress=(lambda line: None) if args.quiet else print)
    print(format_report(record))
    write_json(record, args.json)
    if args.plot:
        title = f"simulated: {cost.model['name']}, {cost.num_gpus} GPUs ({cost.name}), Orca's trace"
        if plot_curves(record["curves"], args.plot, title=title, slo_ms_per_token=args.slo_ms_per_token,
                       slo_label="Orca's SLO"):
            print(f"wrote {args.plot}")
    return 0


def _add_simulate_parser(sub) -> None:
    from orca_jax.bench.simulate import DEFAULT_RATES, PAPER

    p = sub.add_parser("simulate", help="the real scheduler on a cost model's clock, at the paper's scale")
    p.add_argument("--cost-model", default="gpt3-175b-16xa100", help="a shipped cost model's name or a .toml file")
    p.add_argument("--rates", type=_rates, default=DEFAULT_RATES, help="comma-separated arrival rates, requests/s")
    p.add_argument("--num-requests", type=_positive_int, default=1000, help="requests per rate")
    p.add_argument("--scale", type=_positive_float, default=1.0, help="length scale of Orca's trace (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace")
    p.add_argument("--slo-ms-per-token", type=_positive_float, default=PAPER["slo_ms_per_token"],
                   help=f"latency of the headline ratio (default: the paper's {PAPER['slo_ms_per_token']} ms/token)")
    p.add_argument("--num-pages", type=_positive_int, default=None, help="KV pool (default: from GPU memory)")
    _add_request_returns(p)
    p.add_argument("--batches-in-flight", type=_positive_int, default=None,
                   help="batches in flight at most, one per pipeline stage (default: the cost model's pipeline "
                        "stages, as Orca; 1: each batch crosses every stage before the next is scheduled)")
    p.add_argument("--quiet", action="store_true", help="no line per run")
    p.add_argument("--json", default=f"{RESULTS_DIR}/orca_simulated.json", help="output JSON ('' for none)")
    p.add_argument("--plot", default=f"{RESULTS_DIR}/orca_simulated.png", help="output figure ('' for none)")
    p.set_defaults(func=cmd_simulate)


# ---- bench startup ---------------------------------------------------------------------------------
def cmd_startup(args) -> int:
    import shlex

    from orca_jax.bench.environment import command_from_args
    from orca_jax.bench.startup import StartupSettings, format_report, run_startup

    settings = StartupSettings(model=args.model, prompt=args.prompt, max_tokens=args.max_tokens,
                               repeats=args.repeats, generate_args=tuple(shlex.split(args.generate_args)))
    record = run_startup(settings, command_from_args("startup", args), progress=lambda line: print(line, flush=True))
    print(format_report(record))
    write_json(record, args.json)
    return 0


def _add_startup_parser(sub) -> None:
    from orca_jax.bench.startup import DEFAULT_PROMPT

    p = sub.add_parser("startup", help="process start to first token of `orca-jax generate`, cold and warm caches")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"the chat prompt (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--max-tokens", type=_positive_int, default=8, help="tokens to generate (default 8)")
    p.add_argument("--repeats", type=_positive_int, default=3, help="cold and warm runs each (default 3)")
    p.add_argument("--generate-args", default="", metavar="FLAGS",
                   help="more `orca-jax generate` flags, quoted as one string (e.g. '--max-num-batched-tokens 128')")
    p.add_argument("--json", default=f"{RESULTS_DIR}/startup_cpu.json", help="output JSON ('' for none)")
    p.set_defaults(func=cmd_startup)


# ---- bench host -----------------------------------------------------------------------------------
def _sizes(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers; empty for none."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return values


def cmd_host(args) -> int:
    import sys

    from orca_jax.bench.driver import BenchmarkError
    from orca_jax.bench.environment import command_from_args
    from orca_jax.bench.host import HostSettings, format_report, run_host

    settings = HostSettings(
        models=args.models, num_seqs=args.num_seqs, max_model_lens=args.max_model_len, mixes=args.mixes,
        modes=args.modes, warm_steps=args.warm_steps, steps=args.steps, prompt_len=args.prompt_len,
        long_steps=args.long_steps, long_model=args.long_model, long_mix=args.long_mix, offline=args.offline,
        offline_max_num_seqs=args.offline_max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=args.page_size, switch_interval_s=args.switch_interval, seed=args.seed)
    try:
        record = run_host(settings, command_from_args("host", args), progress=lambda line: print(line, flush=True))
    except BenchmarkError as exc:  # the engine lacks what the bench reads, or a cell went wrong
        print(f"orca-jax bench host: {exc}", file=sys.stderr)
        return 1
    print(format_report(record))
    write_json(record, args.json)
    return 0


def _add_host_parser(sub) -> None:
    from orca_jax.bench.host import HostSettings

    d = HostSettings()
    p = sub.add_parser("host", help="host time per engine step, part by part, and device idle time, "
                                    "synchronous and overlapped scheduling side by side")
    p.add_argument("--models", type=_names, default=d.models,
                   help=f"random host models: tiny, balanced (default {','.join(d.models)}; '' for none)")
    p.add_argument("--num-seqs", type=_sizes, default=d.num_seqs, help="running sequences per cell (default 32,64,128,256)")
    p.add_argument("--max-model-len", type=_sizes, default=d.max_model_lens,
                   help="engines' max_model_len (default 2048,4096,8192)")
    p.add_argument("--mixes", type=_names, default=d.mixes, help="request mixes: greedy, realistic (default both)")
    p.add_argument("--modes", type=_names, default=d.modes, help="scheduling modes: sync, async (default both)")
    p.add_argument("--warm-steps", type=_positive_int, default=d.warm_steps,
                   help=f"decode-only steps in a row before recording (default {d.warm_steps})")
    p.add_argument("--steps", type=_positive_int, default=d.steps, help=f"recorded steps per cell (default {d.steps})")
    p.add_argument("--prompt-len", type=_positive_int, default=d.prompt_len, help=f"prompt tokens (default {d.prompt_len})")
    p.add_argument("--long-steps", type=int, default=d.long_steps,
                   help=f"decode steps before the long cell records (default {d.long_steps}; 0: no long cell)")
    p.add_argument("--long-mix", default=d.long_mix, choices=("greedy", "realistic"),
                   help=f"request mix of the long cell (default {d.long_mix})")
    p.add_argument("--long-model", default=d.long_model,
                   help=f"model of the long cell, also when --models leaves it out (default {d.long_model})")
    p.add_argument("--offline", action="store_true",
                   help="also bench offline's orca_jax run (default model) at --offline-max-num-seqs, per mode")
    p.add_argument("--offline-max-num-seqs", type=_sizes, default=d.offline_max_num_seqs,
                   help="max_num_seqs of the offline runs (default 16,64)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=d.max_num_batched_tokens,
                   help=f"token budget per step, above the largest --num-seqs (default {d.max_num_batched_tokens})")
    p.add_argument("--page-size", type=_positive_int, default=d.page_size, help=f"tokens per KV page (default {d.page_size})")
    p.add_argument("--switch-interval", type=_positive_float, default=d.switch_interval_s,
                   help=f"sys.setswitchinterval while measuring, seconds (default {d.switch_interval_s:g})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the weights and the prompts")
    p.add_argument("--json", default=f"{RESULTS_DIR}/host_cpu.json", help="output JSON ('' for none)")
    p.set_defaults(func=cmd_host)


# ---- bench prefix ----------------------------------------------------------------------------------
def cmd_prefix(args) -> int:
    from orca_jax.bench.environment import command_from_args
    from orca_jax.bench.prefix import PrefixSettings, format_report, run_prefix

    settings = PrefixSettings(
        model=args.model, num_requests=args.num_requests, prefix_len=args.prefix_len,
        question_range=args.question_range, output_len=args.output_len, rate=args.rate or None,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=args.page_size, dtype=args.dtype, seed=args.seed, n_samples=args.n,
        overhead_requests=args.overhead_requests, overhead_rounds=args.overhead_rounds)
    record = run_prefix(settings, command_from_args("prefix", args), progress=lambda line: print(line, flush=True))
    print(format_report(record))
    write_json(record, args.json)
    return 0


def _range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def _add_prefix_parser(sub) -> None:
    from orca_jax.bench.prefix import PrefixSettings

    d = PrefixSettings()
    p = sub.add_parser("prefix", help="prefix caching on vs off: requests sharing a long system prompt, "
                                      "n > 1 sampling, and the cost when nothing is shared")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--num-requests", type=_positive_int, default=d.num_requests,
                   help=f"requests sharing the prefix (default {d.num_requests})")
    p.add_argument("--prefix-len", type=_positive_int, default=d.prefix_len,
                   help=f"tokens of the shared system prompt (default {d.prefix_len})")
    p.add_argument("--question-range", type=_range, default=d.question_range, metavar="LOW,HIGH",
                   help="tokens of each request's own question, uniform (default %d,%d)" % d.question_range)
    p.add_argument("--output-len", type=_positive_int, default=d.output_len,
                   help=f"output tokens per request, EOS ignored (default {d.output_len})")
    p.add_argument("--rate", type=float, default=d.rate,
                   help=f"Poisson arrival rate of the second run, requests/s; 0 skips it (default {d.rate:g})")
    p.add_argument("--max-num-seqs", type=_positive_int, default=d.max_num_seqs,
                   help=f"max batch size, both engines (default {d.max_num_seqs})")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=d.max_num_batched_tokens,
                   help=f"token budget per step (default {d.max_num_batched_tokens})")
    p.add_argument("--page-size", type=_positive_int, default=d.page_size,
                   help=f"tokens per KV page, the unit of sharing (default {d.page_size})")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype,
                   help=f"engine dtype (default {d.dtype})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the prompts and arrivals")
    p.add_argument("--n", type=int, default=d.n_samples, help=f"samples of the n > 1 check; 0 skips it "
                                                              f"(default {d.n_samples})")
    p.add_argument("--overhead-requests", type=int, default=d.overhead_requests,
                   help=f"requests of Orca's trace for the no-sharing cost; 0 skips it (default {d.overhead_requests})")
    p.add_argument("--overhead-rounds", type=_positive_int, default=d.overhead_rounds,
                   help=f"alternating rounds of the no-sharing runs (default {d.overhead_rounds})")
    p.add_argument("--json", default=f"{RESULTS_DIR}/prefix_cpu.json", help="output JSON ('' for none)")
    p.set_defaults(func=cmd_prefix)


# ---- bench structured ------------------------------------------------------------------------------
def cmd_structured(args) -> int:
    import sys

    from orca_jax.bench.driver import BenchmarkError
    from orca_jax.bench.environment import command_from_args
    from orca_jax.bench.structured import StructuredSettings, format_report, run_structured

    settings = StructuredSettings(
        model=args.model, num_seqs=args.num_seqs, fractions=args.fractions, rounds=args.rounds,
        output_len=args.output_len, prompt_len=args.prompt_len, min_items=args.min_items,
        max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size, dtype=args.dtype,
        seed=args.seed, compile_repeats=args.compile_repeats, sync_baseline=not args.no_sync_baseline,
        switch_interval_s=args.switch_interval)
    try:
        record = run_structured(settings, command_from_args("structured", args),
                                progress=lambda line: print(line, flush=True))
    except BenchmarkError as exc:  # a request failed or made the wrong number of tokens
        print(f"orca-jax bench structured: {exc}", file=sys.stderr)
        return 1
    print(format_report(record))
    write_json(record, args.json)
    return 0


def _fractions(text: str) -> tuple[float, ...]:
    """Comma-separated shares in [0, 1], 0 among them (the baseline of the ratios)."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"fractions must be comma-separated numbers, got {text!r}") from None
    if 0.0 not in values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"fractions must lie in [0, 1] and include 0, got {text!r}")
    return values


def _add_structured_parser(sub) -> None:
    from orca_jax.bench.structured import StructuredSettings

    d = StructuredSettings()
    p = sub.add_parser("structured", help="constrained decoding's cost: 0/50/100%% of N sequences under a JSON "
                                          "schema, by turns; grammar compile times")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--num-seqs", type=_sizes, default=d.num_seqs,
                   help="batch sizes N, one engine each with max_num_seqs = N (default %s)" % ",".join(map(str, d.num_seqs)))
    p.add_argument("--fractions", type=_fractions, default=d.fractions,
                   help="constrained shares of the N requests, 0 included (default %s)" % ",".join(map(str, d.fractions)))
    p.add_argument("--rounds", type=_positive_int, default=d.rounds,
                   help=f"rounds of the fractions by turns, medians (default {d.rounds})")
    p.add_argument("--output-len", type=_positive_int, default=d.output_len,
                   help=f"output tokens of every request, EOS ignored (default {d.output_len})")
    p.add_argument("--prompt-len", type=_positive_int, default=d.prompt_len,
                   help=f"random prompt tokens per request (default {d.prompt_len})")
    p.add_argument("--min-items", type=_positive_int, default=d.min_items,
                   help=f"records the schema requires, so it never completes (default {d.min_items})")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=d.max_num_batched_tokens,
                   help=f"token budget per step, >= every N (default {d.max_num_batched_tokens})")
    p.add_argument("--page-size", type=_positive_int, default=d.page_size, help=f"tokens per KV page (default {d.page_size})")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype, help=f"engine dtype (default {d.dtype})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the prompts and the engine")
    p.add_argument("--compile-repeats", type=_positive_int, default=d.compile_repeats,
                   help=f"cold compiles per schema for the compile times, medians (default {d.compile_repeats})")
    p.add_argument("--no-sync-baseline", action="store_true",
                   help="skip the 0%% runs on a twin engine with async scheduling off (the worth of the overlap)")
    p.add_argument("--switch-interval", type=_positive_float, default=d.switch_interval_s,
                   help=f"sys.setswitchinterval while measuring, seconds (default {d.switch_interval_s:g})")
    p.add_argument("--json", default=f"{RESULTS_DIR}/structured_cpu.json", help="output JSON ('' for none)")
    p.set_defaults(func=cmd_structured)


# ---- bench spec ------------------------------------------------------------------------------------
def cmd_spec(args) -> int:
    import sys

    from orca_jax.bench.driver import BenchmarkError
    from orca_jax.bench.environment import command_from_args
    from orca_jax.bench.spec import SpecSettings, format_report, run_spec

    base = SpecSettings.quick() if args.quick else SpecSettings()
    given = {name: getattr(args, name) for name in (
        "batch_sizes", "workloads", "ngram_k", "draft_k", "rounds", "copy_output_len", "copy_sentences",
        "random_scale", "random_requests_per_slot", "max_num_batched_tokens", "page_size", "switch_interval_s")
        if getattr(args, name) is not None}
    settings = dataclasses.replace(base, model=args.model, draft_model=args.draft_model, dtype=args.dtype,
                                   seed=args.seed, **given)
    try:
        record = run_spec(settings, command_from_args("spec", args), progress=lambda line: print(line, flush=True))
    except BenchmarkError as exc:  # a request failed, made the wrong number of tokens, or counters disagree
        print(f"orca-jax bench spec: {exc}", file=sys.stderr)
        return 1
    print(format_report(record))
    write_json(record, args.json)
    if not record["greedy_outputs_identical"]:
        print("orca-jax bench spec: greedy outputs with speculation DIFFER from those without (see "
              "`differing_requests` in the runs)", file=sys.stderr)
        return 1
    return 0


def _add_spec_parser(sub) -> None:
    from orca_jax.bench.spec import WORKLOADS, SpecSettings

    d = SpecSettings()
    p = sub.add_parser("spec", help="speculative decoding (n-gram, draft model) against none: a copy-heavy "
                                    "workload and Orca's random trace at batch 1, 4, 16, by turns")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--draft-model", default=None,
                   help="the draft model's checkpoint (default: the target itself, the acceptance upper bound)")
    p.add_argument("--quick", action="store_true",
                   help="small defaults for a tiny model (the tests): batch 1,2, n-gram and draft k 3, 16-token outputs, "
                        "a token budget of 8")
    p.add_argument("--batch-sizes", type=_sizes, default=None,
                   help="requests in flight; one engine per configuration at the largest (default %s)"
                        % ",".join(map(str, d.batch_sizes)))
    p.add_argument("--workloads", type=_names, default=None,
                   help=f"comma-separated among {','.join(WORKLOADS)} (default both)")
    p.add_argument("--ngram-k", type=_sizes, default=None,
                   help="n-gram num_speculative_tokens, one engine each; '' for none (default %s)"
                        % ",".join(map(str, d.ngram_k)))
    p.add_argument("--draft-k", type=_sizes, default=None,
                   help="draft-model num_speculative_tokens, one engine each; '' for none (default %s)"
                        % ",".join(map(str, d.draft_k)))
    p.add_argument("--rounds", type=_positive_int, default=None,
                   help=f"rounds of the configurations by turns, medians (default {d.rounds})")
    p.add_argument("--copy-output-len", type=_positive_int, default=None,
                   help=f"output tokens of each copy request, EOS ignored (default {d.copy_output_len})")
    p.add_argument("--copy-sentences", type=_positive_int, default=None,
                   help=f"sentences of the passage to repeat (default all {d.copy_sentences})")
    p.add_argument("--random-scale", type=_positive_float, default=None,
                   help=f"length scale of Orca's random trace (default {d.random_scale:g}: input U[8, 128], "
                        "output U[1, 32])")
    p.add_argument("--random-requests-per-slot", type=_positive_int, default=None,
                   help=f"random trace at batch B: B times this many requests, B in flight "
                        f"(default {d.random_requests_per_slot})")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help=f"token budget per step (default {d.max_num_batched_tokens})")
    p.add_argument("--page-size", type=_positive_int, default=None, help=f"tokens per KV page (default {d.page_size})")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype, help=f"engine dtype (default {d.dtype})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random trace and the engines")
    p.add_argument("--switch-interval", dest="switch_interval_s", type=_positive_float, default=None,
                   help=f"sys.setswitchinterval while measuring, seconds (default {d.switch_interval_s:g})")
    p.add_argument("--json", default=f"{RESULTS_DIR}/spec_cpu.json", help="output JSON ('' for none)")
    p.set_defaults(func=cmd_spec)


# ---- bench quant -----------------------------------------------------------------------------------
def cmd_quant(args) -> int:
    import sys

    from orca_jax.bench.driver import BenchmarkError
    from orca_jax.bench.environment import command_from_args
    from orca_jax.bench.quant import QuantSettings, format_report, format_serve_report, run_quant, run_serve_only

    base = QuantSettings.quick() if args.quick else QuantSettings()
    given = {name: getattr(args, name) for name in (
        "configs", "batch_sizes", "prompt_len", "decode_tokens", "rounds", "agreement_tokens", "offline_requests",
        "offline_scale", "offline_rounds", "max_num_batched_tokens", "page_size", "max_model_len",
        "kv_cache_memory_bytes", "serve_configs", "serve_parallel", "settle_s") if getattr(args, name) is not None}
    run, report = (run_serve_only, format_serve_report) if args.serve_only else (run_quant, format_report)
    try:
        settings = dataclasses.replace(base, model=args.model, seed=args.seed, serve_only=args.serve_only, **given)
        record = run(settings, command_from_args("quant", args), progress=lambda line: print(line, flush=True))
    except (BenchmarkError, ValueError) as exc:  # a request failed or made the wrong number of tokens, a server
        # did not start, or the settings do not go together
        print(f"orca-jax bench quant: {exc}", file=sys.stderr)
        return 1
    print(report(record))
    write_json(record, args.out)
    return 0


def _add_quant_parser(sub) -> None:
    from orca_jax.bench.quant import CONFIGS, SERVE_CONFIGS, QuantSettings

    d = QuantSettings()
    p = sub.add_parser("quant", help="int8 / GGUF-block weights and an 8-bit KV cache against float32 and bfloat16: "
                                     "memory, KV pool, decode and offline speed, greedy agreement, idle server RSS")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--quick", action="store_true",
                   help="small defaults for a tiny model (the tests): configs float32,bfloat16,int8+kv_int8,gguf, batch "
                        "1,2, 8-token outputs, 2 rounds, one token bucket, a 64 KiB KV budget, two small servers at once")
    p.add_argument("--configs", type=_names, default=None,
                   help=f"comma-separated among {','.join(CONFIGS)} (default {','.join(d.configs)})")
    p.add_argument("--batch-sizes", type=_sizes, default=None,
                   help="decode batch sizes; max_num_seqs is the largest (default %s)" % ",".join(map(str, d.batch_sizes)))
    p.add_argument("--prompt-len", type=_positive_int, default=None,
                   help=f"prompt tokens of the decode requests (default {d.prompt_len})")
    p.add_argument("--decode-tokens", type=_positive_int, default=None,
                   help=f"output tokens of each decode request, EOS ignored (default {d.decode_tokens})")
    p.add_argument("--rounds", type=_positive_int, default=None,
                   help=f"decode rounds of the configurations by turns, medians (default {d.rounds})")
    p.add_argument("--agreement-tokens", type=_positive_int, default=None,
                   help=f"greedy tokens compared with float32's (default {d.agreement_tokens})")
    p.add_argument("--offline-requests", type=_positive_int, default=None,
                   help=f"requests of Orca's trace, all at t=0 (default {d.offline_requests})")
    p.add_argument("--offline-scale", type=_positive_float, default=None,
                   help=f"length scale of Orca's trace (default {d.offline_scale:g}: input U[8, 128], output U[1, 32])")
    p.add_argument("--offline-rounds", type=_positive_int, default=None,
                   help=f"offline runs per configuration, by turns (default {d.offline_rounds})")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help=f"token budget per step (default {d.max_num_batched_tokens})")
    p.add_argument("--page-size", type=_positive_int, default=None, help=f"tokens per KV page (default {d.page_size})")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help=f"every engine's max_model_len (default {d.max_model_len})")
    p.add_argument("--kv-cache-memory-bytes", type=_positive_int, default=None,
                   help=f"every engine's KV byte budget (default {d.kv_cache_memory_bytes} = "
                        f"{d.kv_cache_memory_bytes / 2**20:g} MiB)")
    p.add_argument("--serve-configs", type=_names, default=None,
                   help=f"idle `orca-jax serve` memory, comma-separated among {','.join(SERVE_CONFIGS)}; '' for none "
                        f"(default {','.join(d.serve_configs)})")
    p.add_argument("--serve-parallel", default=None, action=argparse.BooleanOptionalAction,
                   help="start the servers at once (default: one after another; --quick: at once)")
    p.add_argument("--settle", dest="settle_s", type=float, default=None,
                   help=f"idle seconds after /health answers before reading a server's memory (default {d.settle_s:g})")
    p.add_argument("--serve-only", action="store_true",
                   help="only the idle servers of --serve-configs (no engine in this process; one after another "
                        "unless --serve-parallel)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the offline trace and the engines")
    p.add_argument("--out", "--json", dest="out", default=f"{RESULTS_DIR}/quant_cpu.json",
                   help="output JSON ('' for none)")
    p.set_defaults(func=cmd_quant)


def add_bench_parser(subparsers) -> None:
    """Register `bench` and its subcommands on the top-level `orca-jax` parser."""
    bench = subparsers.add_parser("bench", help="benchmarks: Orca's experiment, peers, HTTP load, simulation")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_orca_parser(sub)
    _add_offline_parser(sub)
    _add_serve_parser(sub)
    _add_simulate_parser(sub)
    _add_startup_parser(sub)
    _add_host_parser(sub)
    _add_prefix_parser(sub)
    _add_structured_parser(sub)
    _add_spec_parser(sub)
    _add_quant_parser(sub)
