"""`orca-jax` command line.

    orca-jax generate "PROMPT"   stream one completion to the terminal
    orca-jax serve [MODEL]       OpenAI-compatible HTTP server (see orca_jax/entrypoints/server.py); multi-host
                                 with --coordinator-address/--num-processes/--process-id
    orca-jax convert MODEL DIR   convert weights once into an orbax checkpoint (orca_jax/loading/convert.py)
    orca-jax bench orca|offline|serve|simulate   Orca's experiment and its peers (orca_jax/bench/)

Both take `--config PRESET` (configs/*.toml, see orca_jax/entrypoints/presets.py); flags override it.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from pathlib import Path

from orca_jax.config import QUANTIZATION_METHODS, EngineConfig
from orca_jax.core.sampling_params import SamplingParams

logger = logging.getLogger("orca_jax.cli")


DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"  # what clients send for the embedded default model

# Engine flags default to None ("not given") so that only flags typed on the command line
# override a --config preset; EngineConfig supplies the defaults when neither sets a value.
# dest -> EngineConfig field: the flag names are vLLM's, the same as the fields.
ENGINE_FLAGS = ("model", "tokenizer", "revision", "generation_config", "dtype", "kv_cache_dtype", "quantization", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                "attention_impl", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                "enable_expert_parallel",
                "page_size", "num_pages", "gpu_memory_utilization",
                "scheduling", "async_scheduling", "enable_prefix_caching", "compilation_cache_dir",
                "model_cache_dir", "speculative_config", "max_logprobs")
# Flags that turn a cache off: they set the field to None, which "not given" cannot express.
CACHE_OFF_FLAGS = {"no_compilation_cache": "compilation_cache_dir", "no_model_cache": "model_cache_dir"}


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    from orca_jax.config import ATTENTION_IMPLS, DTYPE_ALIASES, DTYPES, KV_CACHE_DTYPES, SCHEDULING_POLICIES

    parser.add_argument("--config", default=None, metavar="PRESET",
                        help="a preset: a name from configs/ (e.g. smollm2-cpu) or a .toml file; flags override it")
    parser.add_argument("--model", default=None,
                        help="HF directory, .gguf file, orca_jax checkpoint or hub id "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer directory or hub id to use instead of the model's (default: the model's)")
    parser.add_argument("--revision", default=None,
                        help="the branch, tag or commit of a hub id --model (refused for a local path)")
    parser.add_argument("--generation-config", default=None, metavar="auto|vllm|DIR",
                        help="request defaults for temperature, top_p, top_k, min_p, repetition_penalty: auto, "
                             "the model's generation_config.json; vllm, none; or DIR's generation_config.json; "
                             "a request's own values win (default: auto)")
    parser.add_argument("--dtype", default=None, choices=("auto", *DTYPES, *DTYPE_ALIASES),
                        help="weights and activations; auto: the checkpoint's dtype on GPU/TPU (float16 on GPUs below sm_80, "
                             "which have no bfloat16), float32 on CPU "
                             f"(default: {EngineConfig.dtype})")
    parser.add_argument("--kv-cache-dtype", default=None, choices=("auto", *KV_CACHE_DTYPES),
                        help="KV cache dtype; auto: the model dtype, but float32 on CPU; int8 / fp8_e4m3: 8-bit "
                             "values with a scale per token and head, about twice the tokens of bfloat16 "
                             "(default: auto)")
    parser.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                        help="quantize the weights at load time: int8 (per output channel), fp8 (e4m3 where "
                             "the device has fp8 units, else int8), gguf (a GGUF file's own Q8_0/Q4 blocks) "
                             "(default: none, or what a quantized checkpoint holds)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help=f"sequences per step (default: {EngineConfig.max_num_seqs})")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per step, decodes and prefill chunks together; the largest compiled "
                             f"bucket (default: {EngineConfig.max_num_batched_tokens})")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest sequence, prompt plus output (default: the model's, lowered only "
                             "if the KV pool cannot hold one such sequence)")
    parser.add_argument("--enable-chunked-prefill", action="store_true",
                        help="accepted for vLLM compatibility: chunked prefill is always on (a long prompt "
                             "is prefilled in chunks that share steps with decodes)")
    parser.add_argument("--max-logprobs", type=int, default=None,
                        help="the most log-probabilities a request may ask for per token (logprobs, "
                             f"top_logprobs, prompt_logprobs) (default: {EngineConfig.max_logprobs})")
    parser.add_argument("--attention-impl", default=None, choices=ATTENTION_IMPLS,
                        help="ragged paged attention kernel; auto picks by backend (default: auto)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                        help=f"devices to shard the model over (default: {EngineConfig.tensor_parallel_size})")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None,
                        help="pipeline stages: the layers split over this many groups of --tensor-parallel-size "
                             "devices, one batch in flight per stage, as Orca (default: "
                             f"{EngineConfig.pipeline_parallel_size})")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                        help="replicas of the whole engine in this process, each on its own --tensor-parallel-size x "
                             "--pipeline-parallel-size devices with its own KV cache; requests go to the least "
                             "loaded, or to the one holding their prompt prefix when loads are close "
                             f"(serve and bench offline; default: {EngineConfig.data_parallel_size})")
    parser.add_argument("--enable-expert-parallel", default=None, action=argparse.BooleanOptionalAction,
                        help="mixture-of-experts models: each of the --tensor-parallel-size devices holds whole "
                             "experts instead of a slice of every expert (default: off)")
    parser.add_argument("--page-size", type=int, default=None,
                        help=f"tokens per KV page (default: {EngineConfig.page_size})")
    parser.add_argument("--num-pages", type=int, default=None,
                        help="KV pages (default: from --gpu-memory-utilization, or 1 GiB on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="fraction of free accelerator memory for the KV cache "
                             f"(default: {EngineConfig.gpu_memory_utilization}; unused on CPU)")
    parser.add_argument("--scheduling", default=None, choices=SCHEDULING_POLICIES,
                        help="iteration-level (Orca); request-level static batching ('request', selective "
                             "batching kept); or 'request_padded', FasterTransformer as Orca measured it "
                             "(prompts padded to the longest, finished slots computed until the batch ends) "
                             "(default: iteration)")
    parser.add_argument("--enable-prefix-caching", default=None, action=argparse.BooleanOptionalAction,
                        help="reuse the KV pages of prompt prefixes already computed (default: on); "
                             "--no-enable-prefix-caching computes every prompt")
    parser.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                        help="overlap the host's work with the device: dispatch step N+1 before reading step "
                             "N's tokens (same outputs); --no-async-scheduling runs one step at a time "
                             "(default: on)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, as vLLM\'s: e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                             '"prompt_lookup_max": 5, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", '
                             '"num_speculative_tokens": 3, "model": "DIR"}\' (default: off; steps then run one at a time)')
    caches = parser.add_argument_group("caches (a second start reuses compiled programs and converted weights)")
    caches.add_argument("--compilation-cache-dir", default=None, metavar="DIR",
                        help="JAX persistent compilation cache (default: ~/.cache/orca_jax/xla, "
                             "or under $ORCA_JAX_CACHE_DIR)")
    caches.add_argument("--no-compilation-cache", action="store_true", help="compile every program at start")
    caches.add_argument("--model-cache-dir", default=None, metavar="DIR",
                        help="converted GGUF weights and tokenizers (default: ~/.cache/orca_jax/models)")
    caches.add_argument("--no-model-cache", action="store_true", help="convert the GGUF file at every start")
    _add_log_level(parser)


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    # Accepted before and after the subcommand; SUPPRESS keeps a subcommand that was not given
    # it from overwriting the top-level value.
    parser.add_argument("--log-level", default=argparse.SUPPRESS, type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                        help="logging level (default: INFO for serve, WARNING otherwise)")


def _engine_config(args, defaults: dict | None = None) -> EngineConfig:
    """The preset (if any), then every engine flag given explicitly on the command line.
    `defaults`: a command's own defaults, under both (EngineConfig's apply where none is set)."""
    from orca_jax.entrypoints.presets import engine_config_from_preset, load_preset

    model_tag = getattr(args, "model_tag", None)  # `orca-jax serve MODEL`, as `vllm serve MODEL`
    if model_tag is not None:
        if args.model is not None and args.model != model_tag:
            raise ValueError(f"two models given: {model_tag!r} and --model {args.model!r}")
        args.model = model_tag
    given = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name, None) is not None}
    for flag, field in CACHE_OFF_FLAGS.items():
        if getattr(args, flag, False):
            if field in given:
                raise ValueError(f"--{flag.replace('_', '-')} contradicts --{field.replace('_', '-')}")
            given[field] = None
    if getattr(args, "engine_seed", None) is not None:
        given["seed"] = args.engine_seed
    preset = load_preset(args.config) if args.config else {}
    if defaults:
        preset = {**preset, "engine": {**defaults, **preset.get("engine", {})}}
    return engine_config_from_preset(preset, **given)


def cmd_generate(args) -> int:
    from orca_jax.engine.engine import LLMEngine
    from orca_jax.entrypoints.chat_template import apply_chat_template

    # One prompt uses few buckets: compile them as they come rather than all up front. Unless a
    # preset or flag says otherwise:
    # - rows for its n samples only, all the sequences there will be (all n run at once, as with
    #   32 rows): the KV pool holds n full-length sequences instead of 1 GiB's worth, allocated
    #   and zeroed at start (0.3 s for 1 GiB on 2 cores), and the programs are smaller;
    # - one step at a time: overlapped, the second step (the first decode, another bucket) is
    #   dispatched, so its program built, before the prefill's token is read, which delays the
    #   first token by a whole build (a compile when cold). Measured on 2 cores, by turns: first
    #   token 4.4 s vs 5.8 s warm, 29 s vs 43 s cold, the rest of 8 tokens no slower (same tokens
    #   either way: tests/engine/test_async_scheduling.py).
    defaults = {"max_num_seqs": min(args.n, EngineConfig.max_num_seqs), "async_scheduling": False}
    config = _engine_config(args, defaults)
    if config.data_parallel_size > 1:
        raise ValueError(f"--data-parallel-size {config.data_parallel_size}: generate runs one prompt on one "
                         "engine; replicas serve many requests (orca-jax serve, bench offline, LLM)")
    engine = LLMEngine(config, warmup=False)
    prompt = args.prompt
    if args.chat:
        prompt = apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, n=args.n)
    engine.add_request("cli", prompt, params)
    printed: set[int] = set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            _print_generation(output, args.n, printed)
    if args.startup_json:
        from orca_jax.bench.startup import write_generate_record

        write_generate_record(args.startup_json, engine, output)
    return 0


def _print_generation(output, n: int, printed: set[int]) -> None:
    """One sample streams as it is generated; several are printed whole, one after another,
    as each finishes (interleaved deltas would be unreadable)."""
    if n == 1:
        sys.stdout.write(output.outputs[0].delta_text + ("\n" if output.finished else ""))
    for completion in output.outputs if n > 1 else ():
        if completion.finish_reason is not None and completion.index not in printed:
            printed.add(completion.index)
            sys.stdout.write(f"--- sample {completion.index} ({completion.finish_reason}) ---\n{completion.text}\n")
    sys.stdout.flush()


def _served_model_name(args, config: EngineConfig) -> str:
    return args.served_model_name or config.model or DEFAULT_SERVED_MODEL_NAME


def cmd_serve(args) -> int:
    from orca_jax.worker import multihost
    from orca_jax.engine.engine import LLMEngine
    from orca_jax.entrypoints.server import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_WAITING_REQUESTS

    if args.max_waiting_requests is None:
        args.max_waiting_requests = DEFAULT_MAX_WAITING_REQUESTS
    if args.max_request_bytes is None:
        args.max_request_bytes = DEFAULT_MAX_REQUEST_BYTES

    if multihost.wants_distributed(args.coordinator_address, args.num_processes):
        multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    config = _engine_config(args)
    if config.data_parallel_size > 1:
        return _serve_replicas(args, config)
    if multihost.is_follower():
        # No server, no scheduler: run the leader's steps on this host's devices until it stops.
        engine = LLMEngine(config, warmup=False)
        multihost.follow(engine.runner, multihost.StepChannel(engine.config))
        return 0
    engine = LLMEngine(config)  # warm-up compiles every bucket before the port opens
    # The engine lives as long as the process: its objects (weights' host copies, modules,
    # programs) leave the collector's generations, so collections while serving scan only
    # what serving allocates (vLLM freezes its heap the same way).
    gc.collect()
    gc.freeze()
    try:
        _serve(args, config, engine)
    finally:
        engine.shutdown()  # multi-host: the followers leave their loop and exit with us
    return 0


def _serve_replicas(args, config: EngineConfig) -> int:
    """--data-parallel-size N: this process's replicas behind one server (with jax.distributed,
    each host serves its own share on its own port; nothing crosses hosts)."""
    from orca_jax.engine.replicas import build_replicas

    engines = build_replicas(config)  # one warm-up for all before the port opens
    gc.collect()
    gc.freeze()
    try:
        _serve(args, config, engines)
    finally:
        for engine in engines:
            engine.shutdown()
    return 0


def _serve(args, config: EngineConfig, engine) -> None:
    from orca_jax.entrypoints.server import ServerSettings, serve

    settings = ServerSettings(
        model_name=_served_model_name(args, config), api_key=args.api_key, max_request_bytes=args.max_request_bytes,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, chat_template=read_chat_template(args.chat_template),
        default_chat_template_kwargs=parse_template_kwargs(args.default_chat_template_kwargs),
        allowed_origins=parse_json_list(args.allowed_origins, "--allowed-origins"),
        allowed_methods=parse_json_list(args.allowed_methods, "--allowed-methods"),
        allowed_headers=parse_json_list(args.allowed_headers, "--allowed-headers"),
        enable_request_id_headers=args.enable_request_id_headers, enable_log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
    )
    logger.info("serving %r at http://%s:%d/v1 (OpenAI-compatible; /health, /metrics)",
                settings.model_name, args.host, args.port)
    serve(engine, settings, host=args.host, port=args.port, max_waiting_requests=args.max_waiting_requests,
          log_level=args.log_level.lower(), graceful_shutdown_s=args.graceful_shutdown_timeout,
          ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, root_path=args.root_path)


def cmd_convert(args) -> int:
    from orca_jax.loading.convert import convert

    model = None if args.model == "default" else args.model
    timings = convert(model, args.out_dir, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                      quantization=args.quantization)
    print(f"saved {args.out_dir} (load + convert {timings['convert_s']:.1f} s, total {timings['total_s']:.1f} s); "
          f"use it as --model {args.out_dir}")
    return 0


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a path to a template file, else the template text itself (vLLM's rule)."""
    if value is None:
        return None
    try:
        is_file = Path(value).is_file()
    except OSError:  # a name too long for the file system: template text
        is_file = False
    if is_file:
        return Path(value).read_text()
    if "{" not in value:
        raise SystemExit(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


def parse_template_kwargs(value: str | None) -> dict | None:
    return _json_flag(value, "--default-chat-template-kwargs", "a JSON object", lambda v: isinstance(v, dict))


def parse_json_list(value: str | None, flag: str) -> list[str] | None:
    return _json_flag(value, flag, "a JSON list of strings",
                      lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v))


def _json_flag(value: str | None, flag: str, expected: str, fits):
    """A flag's JSON value (None if not given); SystemExit naming the flag unless `fits` it."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise SystemExit(f"{flag} must be {expected}: {exc}") from None
    if not fits(parsed):
        raise SystemExit(f"{flag} must be {expected}")
    return parsed


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    # The server's own defaults are applied in cmd_serve: importing orca_jax.entrypoints.server here (FastAPI,
    # pydantic: ~0.5 s) would charge every `generate` for a parser it does not use.
    from orca_jax.entrypoints.tool_parsers import TOOL_PARSERS
    from orca_jax.entrypoints.reasoning_parsers import REASONING_PARSERS

    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    parser.add_argument("--api-key", default=os.environ.get("ORCA_JAX_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $ORCA_JAX_API_KEY)")
    parser.add_argument("--served-model-name", default=None,
                        help=f"the model name clients send (default: the MODEL argument as given, or "
                             f"{DEFAULT_SERVED_MODEL_NAME!r} for the embedded default)")
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="queued requests before new ones get 503 with Retry-After; with --data-parallel-size, per "
                             "replica (default: the server's, 4096)")
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="larger request bodies get 413 (default: the server's, 1 MiB)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="how tool calls are read out of the reply: hermes (<tool_call>{json}</tool_call>: "
                             "Qwen2.5/Qwen3, Hermes, ...) or llama3_json (Llama 3.1+)")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="split a thinking model's <think> reasoning into the message's reasoning field (and "
                             "reasoning_content): deepseek_r1 (DeepSeek-R1 and its distills) or qwen3; tool calls "
                             "and structured outputs then apply to the answer after it")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                        help="the chat template to render conversations with instead of the model's: a Jinja "
                             "file, or the template itself")
    parser.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                        help='template variables every chat request starts from, e.g. \'{"enable_thinking": '
                             'false}\' (a request\'s chat_template_kwargs override them)')
    parser.add_argument("--allowed-origins", default=None, metavar="JSON",
                        help='CORS: origins browsers may call from, a JSON list (e.g. \'["*"]\'); default: no CORS')
    parser.add_argument("--allowed-methods", default=None, metavar="JSON",
                        help="CORS: allowed methods, a JSON list (default with --allowed-origins: all)")
    parser.add_argument("--allowed-headers", default=None, metavar="JSON",
                        help="CORS: allowed request headers, a JSON list (default with --allowed-origins: all)")
    parser.add_argument("--ssl-keyfile", default=None, help="HTTPS: the private key file (with --ssl-certfile)")
    parser.add_argument("--ssl-certfile", default=None, help="HTTPS: the certificate file (with --ssl-keyfile)")
    parser.add_argument("--root-path", default="", help="the path prefix a reverse proxy serves the API under")
    parser.add_argument("--enable-request-id-headers", action="store_true",
                        help="a client's X-Request-Id header names its request and comes back in the response")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log one line per request: id, prompt lengths, sampling parameters (not the prompt)")
    parser.add_argument("--max-log-len", type=int, default=None,
                        help="with --enable-log-requests, also log this many characters of each prompt")
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
    parser.add_argument("--log-level", default=None, type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                        help="logging level (default: INFO for serve, WARNING otherwise)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0: all (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed: the same seed gives the same text")
    gen.add_argument("--stop", action="append", default=None, metavar="TEXT",
                     help="stop when TEXT is generated (not printed); repeat for several")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument("--n", type=int, default=1, help="samples of the prompt, printed as each finishes (default: 1)")
    gen.add_argument("--startup-json", default=None, metavar="PATH",
                     help="write the start-up phases (seconds) here as JSON, for `orca-jax bench startup`")
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="the model to serve, as in `vllm serve MODEL` (same as --model)")
    _add_engine_args(srv)
    srv.add_argument("--seed", dest="engine_seed", type=int, default=None, metavar="SEED",
                     help="engine seed: the random streams of requests that bring no seed of their own "
                          f"(default: {EngineConfig.seed})")
    _add_serve_args(srv)
    srv.set_defaults(func=cmd_serve)

    conv = sub.add_parser("convert", help="convert HF or GGUF weights once into an orbax checkpoint")
    conv.add_argument("model", help="HF directory, .gguf file or hub id ('default': the embedded SmolLM2)")
    conv.add_argument("out_dir", help="new directory for the checkpoint; use it later as --model / LLM(model=...)")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="dtype of the saved weights (default: float32)")
    conv.add_argument("--tensor-parallel-size", type=int, default=1,
                      help="save sharded over this many devices (restores at any size)")
    conv.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                      help="save the weights quantized (restored as saved, not quantized again)")
    _add_log_level(conv)
    conv.set_defaults(func=cmd_convert)

    from orca_jax.bench.cli import add_bench_parser  # argparse only; the benchmarks import lazily

    add_bench_parser(sub)
    return parser


def _log_level(args) -> str:
    return args.log_level or ("INFO" if args.command == "serve" else "WARNING")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.log_level = _log_level(args)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"orca-jax: error: {exc}", file=sys.stderr)
        return 2

