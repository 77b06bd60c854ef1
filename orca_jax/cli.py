"""`orca-jax` command line: `orca-jax generate "PROMPT"` streams a completion to the terminal."""

from __future__ import annotations

import argparse
import logging
import sys

from orca_jax.config import EngineConfig
from orca_jax.sampling_params import SamplingParams


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF directory, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--attention-impl", default="auto")


def _engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        attention_impl=args.attention_impl,
    )


def cmd_generate(args) -> int:
    from orca_jax.engine import LLMEngine

    # One prompt uses few buckets: compile them as they come rather than all up front.
    engine = LLMEngine(_engine_config(args), warmup=False)
    prompt = args.prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            sys.stdout.write(output.outputs[0].delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


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
