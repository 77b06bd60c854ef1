"""`orca-jax` command line.

    orca-jax generate "PROMPT"   stream one completion to the terminal
    orca-jax serve               OpenAI-compatible HTTP server (see orca_jax/server.py); multi-host
                                 with --coordinator-address/--num-processes/--process-id
    orca-jax convert MODEL DIR   convert weights once into an orbax checkpoint (orca_jax/checkpoint.py)
    orca-jax bench orca|offline|serve|simulate   Orca's experiment and its peers (orca_jax/bench/)

Both take `--config PRESET` (configs/*.toml, see orca_jax/presets.py); flags override it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from orca_jax.config import EngineConfig
from orca_jax.sampling_params import SamplingParams


# Engine flags default to None ("not given") so that only flags typed on the command line
# override a --config preset; EngineConfig supplies the defaults when neither sets a value.
# dest -> EngineConfig field: the flag names are vLLM's, the same as the fields.
ENGINE_FLAGS = ("model", "dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                "attention_impl", "tensor_parallel_size", "page_size", "num_pages", "scheduling")


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="PRESET",
                        help="a preset: a name from configs/ (e.g. smollm2-cpu) or a .toml file; flags override it")
    parser.add_argument("--model", default=None, help="HF directory, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help=f"(default: {EngineConfig.dtype})")
    parser.add_argument("--max-num-seqs", type=int, default=None, help=f"(default: {EngineConfig.max_num_seqs})")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help=f"(default: {EngineConfig.max_num_batched_tokens})")
    parser.add_argument("--max-model-len", type=int, default=None, help="(default: the model's, capped at 4096)")
    parser.add_argument("--attention-impl", default=None, help=f"(default: {EngineConfig.attention_impl})")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help=f"(default: {EngineConfig.tensor_parallel_size})")
    parser.add_argument("--page-size", type=int, default=None, help=f"(default: {EngineConfig.page_size})")
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages (default: from the memory budget)")
    parser.add_argument("--scheduling", default=None, choices=["iteration", "request"],
                        help="iteration-level (Orca) or request-level static batching (default: iteration)")


def _engine_config(args) -> EngineConfig:
    """The preset (if any), then every engine flag given explicitly on the command line."""
    from orca_jax.presets import engine_config_from_preset, load_preset

    given = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    preset = load_preset(args.config) if args.config else {}
    return engine_config_from_preset(preset, **given)


def cmd_generate(args) -> int:
    from orca_jax.engine import LLMEngine
    from orca_jax.llm import apply_chat_template

    # One prompt uses few buckets: compile them as they come rather than all up front.
    engine = LLMEngine(_engine_config(args), warmup=False)
    prompt = args.prompt
    if args.chat:
        prompt = apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            sys.stdout.write(output.outputs[0].delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_serve(args) -> int:
    from orca_jax import multihost
    from orca_jax.engine import LLMEngine
    from orca_jax.server import ServerSettings, serve

    if multihost.wants_distributed(args.coordinator_address, args.num_processes):
        multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    config = _engine_config(args)
    if multihost.is_follower():
        # No server, no scheduler: run the leader's steps on this host's devices until it stops.
        engine = LLMEngine(config, warmup=False)
        multihost.follow(engine.runner, multihost.StepChannel(engine.config))
        return 0
    engine = LLMEngine(config)  # warm-up compiles every bucket before the port opens
    settings = ServerSettings(
        model_name=args.served_model_name or config.model or "SmolLM2-135M-Instruct",
        api_key=args.api_key, max_request_bytes=args.max_request_bytes,
    )
    try:
        serve(engine, settings, host=args.host, port=args.port, max_waiting_requests=args.max_waiting_requests,
              log_level=args.log_level.lower(), graceful_shutdown_s=args.graceful_shutdown_timeout)
    finally:
        engine.shutdown()  # multi-host: the followers leave their loop and exit with us
    return 0


def cmd_convert(args) -> int:
    from orca_jax.checkpoint import convert

    model = None if args.model == "default" else args.model
    timings = convert(model, args.out_dir, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size)
    print(f"saved {args.out_dir} (load + convert {timings['convert_s']:.1f} s, total {timings['total_s']:.1f} s); "
          f"use it as --model {args.out_dir}")
    return 0


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    from orca_jax.server import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_WAITING_REQUESTS

    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("ORCA_JAX_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $ORCA_JAX_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    parser.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="queued requests before new ones get 503 with Retry-After")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="larger request bodies get 413")
    parser.add_argument("--graceful-shutdown-timeout", type=float, default=10.0,
                        help="seconds to wait for open connections at shutdown")
    # Multi-host (jax.distributed): process 0 serves HTTP and schedules, the others follow.
    # On a Cloud TPU VM slice none is needed: JAX reads the slice's own environment.
    parser.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                        help="multi-host: process 0's address for jax.distributed (default: $JAX_COORDINATOR_ADDRESS)")
    parser.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    parser.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index (0 serves)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orca-jax", description="Orca-style LLM serving in JAX")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_engine_args(srv)
    _add_serve_args(srv)
    srv.set_defaults(func=cmd_serve)

    conv = sub.add_parser("convert", help="convert HF or GGUF weights once into an orbax checkpoint")
    conv.add_argument("model", help="HF directory, .gguf file or hub id ('default': the embedded SmolLM2)")
    conv.add_argument("out_dir", help="new directory for the checkpoint; use it later as --model / LLM(model=...)")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    conv.add_argument("--tensor-parallel-size", type=int, default=1,
                      help="save sharded over this many devices (restores at any size)")
    conv.set_defaults(func=cmd_convert)

    from orca_jax.bench.cli import add_bench_parser  # argparse only; the benchmarks import lazily

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"orca-jax: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
