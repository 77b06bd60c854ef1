"""`orca-jax bench orca | offline | serve | simulate | startup | host | prefix | structured | spec | quant`:
each subcommand's options and the call into its benchmark.

The harness (harness.py, arguments.py, environment.py) does the rest: every subcommand prints
its table, writes a JSON record (and a figure where there are curves) and records the exact
command, machine, CPU flags, commit and date inside the JSON. An option that sets a settings
field takes its default from the settings dataclass (`add_setting`), so a default lives in
one place and the help names it.
"""

from __future__ import annotations

import argparse
import os

from orca_jax.bench.arguments import (
    add_json_option, add_model_option, add_setting, fractions, int_range, names, non_negative_int, positive_float,
    positive_floats, positive_int, settings_adder, settings_from_args, sizes)
from orca_jax.bench.harness import RESULTS_DIR, add_subcommand, progress_line, run_benchmark, write_json

DTYPES = ("float32", "bfloat16")


def _omp_bind(text: str) -> str:
    from orca_jax.bench.vllm_peer import valid_omp_bind

    try:
        return valid_omp_bind(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _exit_status(record: dict | None) -> int:
    return 0 if record is not None else 1


def _write_plot(record: dict, path: str, title: str, **kwargs) -> None:
    from orca_jax.bench.plots import plot_curves

    if path and plot_curves(record["curves"], path, title=title, **kwargs):
        print(f"wrote {path}")


def _add_request_returns(p: argparse.ArgumentParser, defaults) -> None:
    add_setting(p, "--request-returns", "request-level responses: 'batch' return together when their static batch "
                "ends (FasterTransformer, Orca's baseline) or 'early', each when it finishes",
                defaults=defaults, choices=("batch", "early"))


# ---- bench orca -------------------------------------------------------------------------------------
def cmd_orca(args) -> int:
    from orca_jax.bench.orca import SweepSettings, format_report, run_sweep

    record = run_benchmark(args, run_sweep, settings_from_args(SweepSettings(), args), format_report)
    if record is not None:
        title = (f"orca_jax, {os.path.basename(str(record['model']))} ({record['machine']['jax_backend']})\n"
                 f"Orca's trace at length scale {args.scale}, max_num_seqs {args.max_num_seqs}, "
                 f"{args.num_requests} requests per rate")
        _write_plot(record, args.plot, title, slo_ms_per_token=record.get("slo_ms_per_token"))
    return _exit_status(record)


def _orca_options(p: argparse.ArgumentParser) -> None:
    from orca_jax.bench.orca import SweepSettings

    d = SweepSettings()
    setting = settings_adder(p, d)
    add_model_option(p, what="HF directory, .gguf file or hub id")
    setting("--scale", "length scale: input U[32, 512] and output U[1, 128] times this",
                type=positive_float)
    setting("--num-requests", "requests per rate", type=positive_int)
    setting("--rates", "comma-separated arrival rates, requests/s", type=positive_floats)
    setting("--max-num-seqs", "max batch size, both policies", type=positive_int)
    setting("--max-num-batched-tokens", "token budget per step", type=positive_int)
    setting("--page-size", "tokens per KV page", type=positive_int)
    p.add_argument("--num-pages", type=positive_int, default=None,
                   help="KV pool, both policies (default: max_num_seqs full-length sequences)")
    setting("--dtype", "engine dtype", choices=DTYPES)
    setting("--seed", "seed of the trace (arrivals, lengths, prompts)", type=int)
    p.add_argument("--slo-ms-per-token", type=positive_float, default=None,
                   help="latency of the headline ratio (default: 2x the unloaded iteration-level latency)")
    setting("--policies", "comma-separated scheduling policies to compare: iteration, request, "
                "request_padded (FasterTransformer's padded rectangles)", type=names)
    setting("--pipeline-parallel-size", "pipeline stages, every policy (on CPU force devices first: "
                "XLA_FLAGS=--xla_force_host_platform_device_count=N)", type=positive_int)
    setting("--tensor-parallel-size", "devices per stage", type=positive_int)
    _add_request_returns(p, d)
    add_json_option(p, f"{RESULTS_DIR}/orca_cpu.json")
    p.add_argument("--plot", default=f"{RESULTS_DIR}/orca_cpu.png", help="output figure ('' for none)")


# ---- bench offline ---------------------------------------------------------------------------------
def cmd_offline(args) -> int:
    from orca_jax.bench.offline import OfflineSettings, format_report, run_offline

    settings = settings_from_args(OfflineSettings(), args, peers=() if args.skip_peers else args.peers)
    return _exit_status(run_benchmark(args, run_offline, settings, format_report))


def _offline_options(p: argparse.ArgumentParser) -> None:
    from orca_jax.bench.offline import OfflineSettings

    d = OfflineSettings()
    setting = settings_adder(p, d)
    add_model_option(p)
    setting("--num-requests", "requests, all arriving at t=0", type=positive_int)
    setting("--scale", "length scale (0.5: input U[16, 256], output U[1, 64]); 1.0 is Orca's trace",
            type=positive_float)
    setting("--max-num-seqs", "orca_jax max_num_seqs; also the static batch size and the continuous peer's "
                "batch", type=positive_int)
    setting("--max-num-batched-tokens", "orca_jax token budget per step; also the continuous peer's "
                "max_batch_tokens", type=positive_int)
    setting("--dtype", "orca_jax dtype (the transformers peers always run float32)", choices=DTYPES)
    p.add_argument("--max-model-len", type=positive_int, default=None, help="orca_jax max_model_len (default: the model's)")
    setting("--page-size", "orca_jax tokens per KV page", type=positive_int)
    setting("--async-scheduling", "orca_jax overlaps the host's work with the device's",
                action=argparse.BooleanOptionalAction)
    p.add_argument("-dp", dest="data_parallel_size", type=positive_int, default=argparse.SUPPRESS,
                   help="short for --data-parallel-size")
    setting("--data-parallel-size", "orca_jax replicas, one per device (on CPU set XLA_FLAGS="
                "--xla_force_host_platform_device_count=N first)", type=positive_int)
    setting("--peers", "comma-separated peers, run in this order after orca_jax: static (transformers' "
                "generate), continuous (transformers' continuous batching), vllm (vLLM's CPU build, its default "
                "OpenMP threads), vllm_bind (vLLM with its OpenMP threads bound to --vllm-omp-bind)", type=names)
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="the Python of vLLM's own environment (default: $ORCA_JAX_VLLM_PYTHON, else this Python "
                        "if it imports vllm, else the environment of a `vllm` command on PATH; none found: "
                        "the vllm peers are skipped)")
    p.add_argument("--vllm-omp-bind", type=_omp_bind, default=None, metavar="CPUS",
                   help="VLLM_CPU_OMP_THREADS_BIND of the vllm_bind peer, e.g. 0-1 (default: every core "
                        "this process may run on)")
    setting("--vllm-timeout", "seconds per vLLM peer: engine start, warm-up and run",
                field="vllm_timeout_s", type=positive_float)
    p.add_argument("--skip-peers", action="store_true", help="run orca_jax only (no torch needed)")
    setting("--seed", "seed of the requests", type=int)
    p.add_argument("--torch-threads", type=positive_int, default=os.cpu_count() or 1,
                   help="torch threads of the peers (default: all cores)")
    setting("--torch-device", "auto (cuda when available), cpu, cuda, cuda:1, ...")
    setting("--matmul-size", "square matmul for the roofline rate", type=positive_int)
    setting("--matmul-repeats", "timed matmuls for the roofline rate", type=positive_int)
    add_json_option(p, None)


# ---- bench serve -----------------------------------------------------------------------------------
def cmd_serve(args) -> int:
    import asyncio

    from orca_jax.bench.environment import command_from_args, now_utc
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
    # The load generator's machine is not the server's: no machine record here.
    record = {"benchmark": "serve", "date": started, "command": command_from_args("serve", args, skip=("api_key",)),
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


def _serve_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--served-model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key (default: $OPENAI_API_KEY)")
    p.add_argument("--rate", type=positive_float, default=None, help="Poisson arrival rate, req/s (default: all at once)")
    p.add_argument("--num-requests", type=positive_int, default=100, help="requests to send (default 100)")
    p.add_argument("--scale", type=positive_float, default=1.0, help="length scale of Orca's trace (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace (default 0)")
    p.add_argument("--tokenizer", default=None,
                   help="the served model's tokenizer, for its vocabulary and special ids (default: ask the server)")
    p.add_argument("--vocab-size", type=positive_int, default=None,
                   help="prompt ids below this, instead of asking the server for its vocabulary")
    p.add_argument("--min-token-id", type=int, default=256,
                   help="with --vocab-size: prompt ids at or above this, away from special tokens (default 256)")
    p.add_argument("--max-concurrency", type=positive_int, default=None, help="requests in flight at most (default: no cap)")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="per request, seconds (default 600)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json_option(p, None)


# ---- bench simulate --------------------------------------------------------------------------------
def cmd_simulate(args) -> int:
    from orca_jax.bench.cost_model import load_cost_model
    from orca_jax.bench.environment import command_from_args
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
                            progress=(lambda line: None) if args.quiet else progress_line)
    print(format_report(record))
    write_json(record, args.json)
    title = f"simulated: {cost.model['name']}, {cost.num_gpus} GPUs ({cost.name}), Orca's trace"
    _write_plot(record, args.plot, title, slo_ms_per_token=args.slo_ms_per_token, slo_label="Orca's SLO")
    return 0


def _simulate_options(p: argparse.ArgumentParser) -> None:
    from orca_jax.bench.orca import SweepSettings
    from orca_jax.bench.simulate import DEFAULT_RATES, PAPER

    p.add_argument("--cost-model", default="gpt3-175b-16xa100",
                   help="a shipped cost model's name or a .toml file (default gpt3-175b-16xa100)")
    p.add_argument("--rates", type=positive_floats, default=DEFAULT_RATES,
                   help="comma-separated arrival rates, requests/s")
    p.add_argument("--num-requests", type=positive_int, default=1000, help="requests per rate (default 1000)")
    p.add_argument("--scale", type=positive_float, default=1.0, help="length scale of Orca's trace (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace (default 0)")
    p.add_argument("--slo-ms-per-token", type=positive_float, default=PAPER["slo_ms_per_token"],
                   help=f"latency of the headline ratio (default: the paper's {PAPER['slo_ms_per_token']:g} ms/token)")
    p.add_argument("--num-pages", type=positive_int, default=None, help="KV pool (default: from GPU memory)")
    _add_request_returns(p, SweepSettings())
    p.add_argument("--batches-in-flight", type=positive_int, default=None,
                   help="batches in flight at most, one per pipeline stage (default: the cost model's pipeline "
                        "stages, as Orca; 1: each batch crosses every stage before the next is scheduled)")
    p.add_argument("--quiet", action="store_true", help="no line per run")
    add_json_option(p, f"{RESULTS_DIR}/orca_simulated.json")
    p.add_argument("--plot", default=f"{RESULTS_DIR}/orca_simulated.png", help="output figure ('' for none)")


# ---- bench startup ---------------------------------------------------------------------------------
def cmd_startup(args) -> int:
    import shlex

    from orca_jax.bench.startup import StartupSettings, format_report, run_startup

    settings = settings_from_args(StartupSettings(), args, generate_args=tuple(shlex.split(args.generate_args)))
    return _exit_status(run_benchmark(args, run_startup, settings, format_report))


def _startup_options(p: argparse.ArgumentParser) -> None:
    from orca_jax.bench.startup import StartupSettings

    d = StartupSettings()
    setting = settings_adder(p, d)
    add_model_option(p)
    p.add_argument("--prompt", default=d.prompt, help=f"the chat prompt (default: {d.prompt!r})")
    setting("--max-tokens", "tokens to generate", type=positive_int)
    setting("--repeats", "cold and warm runs each", type=positive_int)
    p.add_argument("--generate-args", default="", metavar="FLAGS",
                   help="more `orca-jax generate` flags, quoted as one string (e.g. '--max-num-batched-tokens 128')")
    add_json_option(p, f"{RESULTS_DIR}/startup_cpu.json")


# ---- bench host -----------------------------------------------------------------------------------
def cmd_host(args) -> int:
    from orca_jax.bench.host import HostSettings, format_report, run_host

    return _exit_status(run_benchmark(args, run_host, settings_from_args(HostSettings(), args), format_report))


def _host_options(p: argparse.ArgumentParser) -> None:
    from orca_jax.bench.host import HostSettings

    d = HostSettings()
    setting = settings_adder(p, d)
    setting("--models", "random host models: tiny, balanced; '' for none", type=names)
    setting("--num-seqs", "running sequences per cell", type=sizes)
    setting("--max-model-len", "engines' max_model_len", field="max_model_lens", type=sizes)
    setting("--mixes", "request mixes: greedy, realistic", type=names)
    setting("--modes", "scheduling modes: sync, async", type=names)
    setting("--warm-steps", "decode-only steps in a row before recording", type=positive_int)
    setting("--steps", "recorded steps per cell", type=positive_int)
    setting("--prompt-len", "prompt tokens", type=positive_int)
    setting("--long-steps", "decode steps before the long cell records; 0: no long cell",
                type=non_negative_int)
    setting("--long-mix", "request mix of the long cell", choices=("greedy", "realistic"))
    setting("--long-model", "model of the long cell, also when --models leaves it out")
    p.add_argument("--offline", action="store_true",
                   help="also bench offline's orca_jax run (default model) at --offline-max-num-seqs, per mode")
    setting("--offline-max-num-seqs", "max_num_seqs of the offline runs", type=sizes)
    setting("--max-num-batched-tokens", "token budget per step, above the largest --num-seqs",
                type=positive_int)
    setting("--page-size", "tokens per KV page", type=positive_int)
    setting("--switch-interval", "sys.setswitchinterval while measuring, seconds",
                field="switch_interval_s", type=positive_float)
    setting("--seed", "seed of the weights and the prompts", type=int)
    add_json_option(p, f"{RESULTS_DIR}/host_cpu.json")


# ---- bench prefix ----------------------------------------------------------------------------------
def cmd_prefix(args) -> int:
    from orca_jax.bench.prefix import PrefixSettings, format_report, run_prefix

    settings = settings_from_args(PrefixSettings(), args, rate=args.rate or None)
    return _exit_status(run_benchmark(args, run_prefix, settings, format_report))


def _prefix_options(p: argparse.ArgumentParser) -> None:
    from orca_jax.bench.prefix import PrefixSettings

    d = PrefixSettings()
    setting = settings_adder(p, d)
    add_model_option(p)
    setting("--num-requests", "requests sharing the prefix", type=positive_int)
    setting("--prefix-len", "tokens of the shared system prompt", type=positive_int)
    setting("--question-range", "tokens of each request's own question, uniform", type=int_range,
                metavar="LOW,HIGH")
    setting("--output-len", "output tokens per request, EOS ignored", type=positive_int)
    setting("--rate", "Poisson arrival rate of the second run, requests/s; 0 skips it", type=float)
    setting("--max-num-seqs", "max batch size, both engines", type=positive_int)
    setting("--max-num-batched-tokens", "token budget per step", type=positive_int)
    setting("--page-size", "tokens per KV page, the unit of sharing", type=positive_int)
    setting("--dtype", "engine dtype", choices=DTYPES)
    setting("--seed", "seed of the prompts and arrivals", type=int)
    setting("--n", "samples of the n > 1 check; 0 skips it", field="n_samples",
                type=non_negative_int)
    setting("--overhead-requests", "requests of Orca's trace for the no-sharing cost; 0 skips it",
                type=non_negative_int)
    setting("--overhead-rounds", "alternating rounds of the no-sharing runs", type=positive_int)
    add_json_option(p, f"{RESULTS_DIR}/prefix_cpu.json")


# ---- bench structured ------------------------------------------------------------------------------
def cmd_structured(args) -> int:
    from orca_jax.bench.structured import StructuredSettings, format_report, run_structured

    return _exit_status(run_benchmark(args, run_structured, settings_from_args(StructuredSettings(), args),
                                      format_report))


def _structured_options(p: argparse.ArgumentParser) -> None:
    from orca_jax.bench.structured import StructuredSettings

    d = StructuredSettings()
    setting = settings_adder(p, d)
    add_model_option(p)
    setting("--num-seqs", "batch sizes N, one engine each with max_num_seqs = N", type=sizes)
    setting("--fractions", "constrained shares of the N requests, 0 included", type=fractions)
    setting("--rounds", "rounds of the fractions by turns, medians", type=positive_int)
    setting("--output-len", "output tokens of every request, EOS ignored", type=positive_int)
    setting("--prompt-len", "random prompt tokens per request", type=positive_int)
    setting("--min-items", "records the schema requires, so it never completes", type=positive_int)
    setting("--max-num-batched-tokens", "token budget per step, >= every N", type=positive_int)
    setting("--page-size", "tokens per KV page", type=positive_int)
    setting("--dtype", "engine dtype", choices=DTYPES)
    setting("--seed", "seed of the prompts and the engine", type=int)
    setting("--compile-repeats", "cold compiles per schema for the compile times, medians",
                type=positive_int)
    setting("--sync-baseline", "the 0%% runs again on a twin engine with async scheduling off (the worth "
                "of the overlap)", action=argparse.BooleanOptionalAction)
    setting("--switch-interval", "sys.setswitchinterval while measuring, seconds",
                field="switch_interval_s", type=positive_float)
    add_json_option(p, f"{RESULTS_DIR}/structured_cpu.json")


# ---- bench spec ------------------------------------------------------------------------------------
def cmd_spec(args) -> int:
    import sys

    from orca_jax.bench.spec import SpecSettings, format_report, run_spec

    settings = settings_from_args(SpecSettings.quick() if args.quick else SpecSettings(), args)
    record = run_benchmark(args, run_spec, settings, format_report)
    if record is not None and not record["greedy_outputs_identical"]:
        print("orca-jax bench spec: greedy outputs with speculation DIFFER from those without (see "
              "`differing_requests` in the runs)", file=sys.stderr)
        return 1
    return _exit_status(record)


def _spec_options(p: argparse.ArgumentParser) -> None:
    from orca_jax.bench.spec import WORKLOADS, SpecSettings

    d = SpecSettings()

    # None by default: the base is SpecSettings() or .quick().
    quick_setting = settings_adder(p, d, default_from_settings=False)
    setting = settings_adder(p, d)

    add_model_option(p)
    p.add_argument("--draft-model", default=None,
                   help="the draft model's checkpoint (default: the target itself, the acceptance upper bound)")
    p.add_argument("--quick", action="store_true",
                   help="small defaults for a tiny model (the tests): batch 1,2, n-gram and draft k 3, 16-token outputs, "
                        "a token budget of 8")
    quick_setting("--batch-sizes", "requests in flight; one engine per configuration at the largest", type=sizes)
    quick_setting("--workloads", f"comma-separated among {','.join(WORKLOADS)}", type=names)
    quick_setting("--ngram-k", "n-gram num_speculative_tokens, one engine each; '' for none", type=sizes)
    quick_setting("--draft-k", "draft-model num_speculative_tokens, one engine each; '' for none", type=sizes)
    quick_setting("--rounds", "rounds of the configurations by turns, medians", type=positive_int)
    quick_setting("--copy-output-len", "output tokens of each copy request, EOS ignored", type=positive_int)
    quick_setting("--copy-sentences", "sentences of the passage to repeat (default: all)", type=positive_int)
    quick_setting("--random-scale", "length scale of Orca's random trace (0.25: input U[8, 128], output U[1, 32])",
                  type=positive_float)
    quick_setting("--random-requests-per-slot", "random trace at batch B: B times this many requests, B in flight",
                  type=positive_int)
    quick_setting("--max-num-batched-tokens", "token budget per step", type=positive_int)
    quick_setting("--page-size", "tokens per KV page", type=positive_int)
    setting("--dtype", "engine dtype", choices=DTYPES)
    setting("--seed", "seed of the random trace and the engines", type=int)
    quick_setting("--switch-interval", "sys.setswitchinterval while measuring, seconds", field="switch_interval_s",
                  type=positive_float)
    add_json_option(p, f"{RESULTS_DIR}/spec_cpu.json")


# ---- bench quant -----------------------------------------------------------------------------------
def cmd_quant(args) -> int:
    import sys

    from orca_jax.bench.quant import QuantSettings, format_report, format_serve_report, run_quant, run_serve_only

    run, report = (run_serve_only, format_serve_report) if args.serve_only else (run_quant, format_report)
    try:
        settings = settings_from_args(QuantSettings.quick() if args.quick else QuantSettings(), args)
        return _exit_status(run_benchmark(args, run, settings, report))
    except ValueError as exc:  # the settings do not go together, or a server did not start
        print(f"orca-jax bench quant: {exc}", file=sys.stderr)
        return 1


def _quant_options(p: argparse.ArgumentParser) -> None:
    from orca_jax.bench.quant import CONFIGS, SERVE_CONFIGS, QuantSettings

    d = QuantSettings()

    # None by default: the base is QuantSettings() or .quick().
    quick_setting = settings_adder(p, d, default_from_settings=False)
    setting = settings_adder(p, d)

    add_model_option(p)
    p.add_argument("--quick", action="store_true",
                   help="small defaults for a tiny model (the tests): configs float32,bfloat16,int8+kv_int8,gguf, batch "
                        "1,2, 8-token outputs, 2 rounds, one token bucket, a 64 KiB KV budget, two small servers at once")
    quick_setting("--configs", f"comma-separated among {','.join(CONFIGS)}", type=names)
    quick_setting("--batch-sizes", "decode batch sizes; max_num_seqs is the largest", type=sizes)
    quick_setting("--prompt-len", "prompt tokens of the decode requests", type=positive_int)
    quick_setting("--decode-tokens", "output tokens of each decode request, EOS ignored", type=positive_int)
    quick_setting("--rounds", "decode rounds of the configurations by turns, medians", type=positive_int)
    quick_setting("--agreement-tokens", "greedy tokens compared with float32's", type=positive_int)
    quick_setting("--offline-requests", "requests of Orca's trace, all at t=0", type=positive_int)
    quick_setting("--offline-scale", "length scale of Orca's trace (0.25: input U[8, 128], output U[1, 32])",
                  type=positive_float)
    quick_setting("--offline-rounds", "offline runs per configuration, by turns", type=positive_int)
    quick_setting("--max-num-batched-tokens", "token budget per step", type=positive_int)
    quick_setting("--page-size", "tokens per KV page", type=positive_int)
    quick_setting("--max-model-len", "every engine's max_model_len", type=positive_int)
    quick_setting("--kv-cache-memory-bytes", f"every engine's KV byte budget ({d.kv_cache_memory_bytes / 2**20:g} MiB)",
                  type=positive_int)
    quick_setting("--serve-configs", f"idle `orca-jax serve` memory, comma-separated among {','.join(SERVE_CONFIGS)}; "
                  "'' for none", type=names)
    quick_setting("--serve-parallel", "start the servers at once (--quick: at once)",
                  action=argparse.BooleanOptionalAction)
    quick_setting("--settle", "idle seconds after /health answers before reading a server's memory", field="settle_s",
                  type=float)
    p.add_argument("--serve-only", action="store_true",
                   help="only the idle servers of --serve-configs (no engine in this process; one after another "
                        "unless --serve-parallel)")
    setting("--seed", "seed of the offline trace and the engines", type=int)
    add_json_option(p, f"{RESULTS_DIR}/quant_cpu.json", "--out", "--json")


SUBCOMMANDS = (
    ("orca", "Orca's experiment in-process: both scheduling policies over arrival rates", _orca_options, cmd_orca),
    ("offline", "all requests at t=0: orca_jax vs transformers' static and continuous batching (and vLLM's CPU "
                "build, --peers vllm)", _offline_options, cmd_offline),
    ("serve", "replay the trace over HTTP against an OpenAI-compatible server", _serve_options, cmd_serve),
    ("simulate", "the real scheduler on a cost model's clock, at the paper's scale", _simulate_options, cmd_simulate),
    ("startup", "process start to first token of `orca-jax generate`, cold and warm caches", _startup_options,
     cmd_startup),
    ("host", "host time per engine step, part by part, and device idle time, synchronous and overlapped "
             "scheduling side by side", _host_options, cmd_host),
    ("prefix", "prefix caching on vs off: requests sharing a long system prompt, n > 1 sampling, and the cost "
               "when nothing is shared", _prefix_options, cmd_prefix),
    ("structured", "constrained decoding's cost: 0/50/100%% of N sequences under a JSON schema, by turns; grammar "
                   "compile times", _structured_options, cmd_structured),
    ("spec", "speculative decoding (n-gram, draft model) against none: a copy-heavy workload and Orca's random "
             "trace at batch 1, 4, 16, by turns", _spec_options, cmd_spec),
    ("quant", "int8 / GGUF-block weights and an 8-bit KV cache against float32 and bfloat16: memory, KV pool, "
              "decode and offline speed, greedy agreement, idle server RSS", _quant_options, cmd_quant),
)


def add_bench_parser(subparsers) -> None:
    """Register `bench` and its subcommands on the top-level `orca-jax` parser."""
    bench = subparsers.add_parser("bench", help="benchmarks: Orca's experiment, peers, HTTP load, simulation")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, help, add_options, command in SUBCOMMANDS:
        add_subcommand(sub, name, help, add_options, command)
