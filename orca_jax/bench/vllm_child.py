"""The child side of the vLLM peer (vllm_peer.py): run by the Python of vLLM's own environment,
`python vllm_child.py REQUEST.json RESULT.json`.

vLLM brings its own torch, so it cannot share orca_jax's process or environment: this file is
run as a script and imports nothing from orca_jax, only vLLM and the standard library. The
request file (written by vllm_peer.request_document) holds the engine settings and the
requests (prompt token ids, output lengths); greedy, EOS ignored. The result file holds the
wall time of the timed `generate` alone (engine construction and one warm-up `generate` come
first, timed on their own), and what each request produced, for the parent to check.
"""

from __future__ import annotations

import json
import sys
import time


def build_llm(request: dict):
    from vllm import LLM

    return LLM(
        model=request["model"],
        dtype=request["dtype"],
        max_num_seqs=request["max_num_seqs"],
        max_num_batched_tokens=request["max_num_batched_tokens"],
        max_model_len=request["max_model_len"],  # None: the model's own
        kv_cache_memory_bytes=request["kv_cache_memory_bytes"],
        enable_prefix_caching=request["enable_prefix_caching"],
        seed=request["seed"],
    )


def greedy_no_eos(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list]:
    """(seconds, outputs) of one `generate` over token-id prompts, each with its own length."""
    from vllm.inputs import TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [greedy_no_eos(m) for m in max_tokens]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def engine_settings(llm) -> dict:
    """What vLLM resolved from the arguments (block size and KV space are its own choices on CPU)."""
    config = llm.llm_engine.vllm_config
    return {
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_model_len": config.model_config.max_model_len,
        "dtype": str(config.model_config.dtype),
        "block_size": config.cache_config.block_size,
        "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
    }


def run(request: dict) -> dict:
    import vllm

    start = time.perf_counter()
    llm = build_llm(request)
    load_s = time.perf_counter() - start
    warm = request["warmup"]
    warmup_s, _ = generate(llm, [warm["prompt"]], [warm["max_tokens"]])
    wall_s, outputs = generate(llm, request["prompts"], request["max_tokens"])
    completions = [out.outputs[0] for out in outputs]
    return {
        "vllm_version": vllm.__version__,
        "load_s": load_s,
        "warmup_generate_s": warmup_s,
        "wall_s": wall_s,
        "output_lens": [len(c.token_ids) for c in completions],
        "finish_reasons": [c.finish_reason for c in completions],
        "engine_settings": engine_settings(llm),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python vllm_child.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    request_path, result_path = argv
    with open(request_path) as f:
        request = json.load(f)
    result = run(request)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
