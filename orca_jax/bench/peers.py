"""transformers' two batching modes, the peers of `bench offline`, on the same weights and
requests as orca_jax:

* hf_static      `model.generate` on batches of `batch_size` requests in arrival order, left
                 padded, each batch run to its longest output. Only each request's own tokens are
                 useful; the padding and the extra decode steps are counted as wasted.
* hf_continuous  transformers' continuous batching manager (`init_continuous_batching`), each
                 request added with its own `max_new_tokens` and EOS disabled.

vLLM's CPU build is the third peer (vllm_peer.py), run in its own environment.

torch is needed only here; without it the peers fail with one clear message. On a machine with
CUDA the peers run there (`device="auto"`), with the same code.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from orca_jax.bench.driver import BenchmarkError
from orca_jax.bench.trace import Trace

SYSTEM_NAMES = {"orca": "orca_jax", "static": "hf_static", "continuous": "hf_continuous",
                "vllm": "vllm_cpu", "vllm_bind": "vllm_cpu_bind"}
HF_PEERS = ("static", "continuous")
VLLM_PEERS = ("vllm", "vllm_bind")  # vLLM's CPU build in its own environment (vllm_peer.py)
PEERS = HF_PEERS + VLLM_PEERS
DEFAULT_PEERS = HF_PEERS  # vLLM is asked for by name: it needs an environment of its own


def import_torch():
    try:
        import torch
    except ImportError:
        raise RuntimeError(
            "the transformers peers need PyTorch, which orca_jax itself does not: "
            "pip install torch (or run `orca-jax bench offline --skip-peers`)"
        ) from None
    return torch


def resolve_device(device: str) -> str:
    torch = import_torch()
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def system_result(name: str, trace: Trace, wall_s: float, processed: int, wasted: int, **extra) -> dict[str, Any]:
    useful = trace.useful_output_tokens
    return {
        "system": name,
        "requests": trace.num_requests,
        "useful_output_tokens": useful,
        "processed_tokens": processed,  # prompt + output tokens the model ran, padding included
        "wasted_tokens": wasted,  # of which padding / tokens past a request's own length
        "wall_s": wall_s,
        "useful_output_tokens_per_s": useful / wall_s,
        **extra,
    }


def hf_load_kwargs(model: str | None) -> tuple[str, dict[str, Any]]:
    """The `from_pretrained` arguments that load the same weights orca_jax loads."""
    from orca_jax.loading.loader import resolve_model_path

    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return str(path), {"gguf_file": ggufs[0].name}
    return str(path), {}


def load_hf_model(model: str | None, device: str = "cpu"):
    """(model in float32 on `device`, load seconds, weight bytes)."""
    torch = import_torch()
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the GGUF conversion bars would bury the table
    directory, kwargs = hf_load_kwargs(model)
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval().to(device)
    load_s = time.perf_counter() - start
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    return hf, load_s, weight_bytes


def _greedy_no_eos_config(hf, **overrides):
    """Greedy decoding that never stops at EOS. The model's own generation config is replaced,
    since `generate` fills unset fields (eos_token_id among them) from it."""
    from transformers import GenerationConfig

    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    hf.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=pad,
                                            bos_token_id=hf.config.bos_token_id)
    return GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=pad, **overrides), pad


def _static_generate(hf, prompts: list[list[int]], max_new: int, gen_config, pad: int) -> int:
    """One left-padded batch to `max_new` new tokens; returns the padded prompt width."""
    torch = import_torch()
    gen_config = copy.deepcopy(gen_config)
    gen_config.max_new_tokens, gen_config.min_new_tokens = max_new, None
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    with torch.inference_mode():
        out = hf.generate(input_ids=ids.to(hf.device), attention_mask=mask.to(hf.device), generation_config=gen_config)
    if tuple(out.shape) != (len(prompts), width + max_new):
        raise BenchmarkError(
            f"hf_static: generate returned shape {tuple(out.shape)}, expected {(len(prompts), width + max_new)} "
            "(did it stop early?)"
        )
    return width


def run_hf_static(hf, trace: Trace, batch_size: int) -> dict[str, Any]:
    """Static batching: batches of `batch_size` in arrival order, left padded, each run until its
    longest request is done."""
    gen_config, pad = _greedy_no_eos_config(hf)
    start = time.perf_counter()
    _static_generate(hf, [trace.prompts[0][:8]] * 2, 2, gen_config, pad)
    warmup_s = time.perf_counter() - start

    processed = 0
    start = time.perf_counter()
    for first in range(0, trace.num_requests, batch_size):
        prompts = trace.prompts[first:first + batch_size]
        max_new = max(trace.output_lens[first:first + batch_size])
        width = _static_generate(hf, prompts, max_new, gen_config, pad)
        processed += len(prompts) * (width + max_new)
    wall_s = time.perf_counter() - start
    return system_result(SYSTEM_NAMES["static"], trace, wall_s, processed, processed - trace.useful_processed_tokens,
                         warmup_generate_s=warmup_s, batch_size=batch_size,
                         num_batches=-(-trace.num_requests // batch_size))


def _collect_cb(manager, request_ids: list[str]) -> dict[str, Any]:
    pending, results = set(request_ids), {}
    while pending:
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                error = manager.background_thread_status.fatal_error
                raise BenchmarkError(f"hf_continuous: the generation thread stopped with requests pending ({error!r})")
            continue
        if result.is_finished() and result.request_id in pending:
            pending.discard(result.request_id)
            results[result.request_id] = result
    return results


def _cb_config(trace: Trace, max_num_seqs: int, max_num_batched_tokens: int, page_size: int, seed: int):
    from transformers import ContinuousBatchingConfig

    longest = max(i + o for i, o in zip(trace.input_lens, trace.output_lens))
    return ContinuousBatchingConfig(
        page_size=page_size,
        # Room for max_num_seqs requests at the workload's longest length, so it never evicts.
        num_blocks=max_num_seqs * -(-longest // page_size),
        max_batch_tokens=max_num_batched_tokens,
        max_requests_per_batch=max_num_seqs,
        allow_block_sharing=False,  # no prefix caching: orca_jax has none
        use_cuda_graph=False,
        use_async_batching=False,
        seed=seed,
    )


def run_hf_continuous(hf, trace: Trace, *, max_num_seqs: int, max_num_batched_tokens: int, page_size: int,
                      seed: int) -> dict[str, Any]:
    """transformers continuous batching (`init_continuous_batching` -> ContinuousBatchingManager),
    every request added with its own `max_new_tokens` and `eos_token_id=-1` (no EOS)."""
    torch = import_torch()
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen_config, _ = _greedy_no_eos_config(hf, max_new_tokens=max(trace.output_lens))
    gen_config.eos_token_id = -1  # the manager's own spelling of "no EOS" (None makes it warn, then use -1)
    hints = WorkloadHints(max_prompt_length=max(trace.input_lens), max_generated_length=max(trace.output_lens),
                          num_requests=trace.num_requests)
    start = time.perf_counter()
    manager = hf.init_continuous_batching(
        generation_config=gen_config, workload_hints=hints,
        continuous_batching_config=_cb_config(trace, max_num_seqs, max_num_batched_tokens, page_size, seed))
    try:
        manager.warmup()
        with torch.inference_mode():  # the loop thread inherits the caller's inference mode
            manager.start()
        warm_id = manager.add_request(trace.prompts[0][:8], request_id="warmup", max_new_tokens=2, eos_token_id=-1)
        if warm_id is None:
            raise BenchmarkError("hf_continuous: the manager refused the warm-up request")
        warm = _collect_cb(manager, [warm_id])[warm_id]
        if warm.error is not None:
            raise BenchmarkError(f"hf_continuous: the warm-up request failed: {warm.error}")
        warmup_s = time.perf_counter() - start

        start = time.perf_counter()
        ids = []
        for i, (prompt, out_len) in enumerate(zip(trace.prompts, trace.output_lens)):
            request_id = manager.add_request(prompt, request_id=f"req-{i}", max_new_tokens=out_len, eos_token_id=-1)
            if request_id is None:
                raise BenchmarkError(f"hf_continuous: the manager refused request {i}")
            ids.append(request_id)
        results = _collect_cb(manager, ids)
        wall_s = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()

    for i, (request_id, want) in enumerate(zip(ids, trace.output_lens)):
        r = results[request_id]
        if r.error is not None:
            raise BenchmarkError(f"hf_continuous request {i} failed: {r.error}")
        if len(r.generated_tokens) != want:
            raise BenchmarkError(f"hf_continuous request {i} produced {len(r.generated_tokens)} tokens, expected {want}")
    resolved = manager.continuous_batching_config
    return system_result(
        SYSTEM_NAMES["continuous"], trace, wall_s, trace.useful_processed_tokens, 0,
        warmup_generate_s=warmup_s, api="PreTrainedModel.init_continuous_batching + ContinuousBatchingManager.add_request",
        per_request_max_new_tokens=True, attn_implementation=hf.config._attn_implementation,
        cb_config={k: getattr(resolved, k) for k in ("page_size", "num_blocks", "max_batch_tokens",
                                                     "max_requests_per_batch", "allow_block_sharing", "scheduler_type")},
    )
