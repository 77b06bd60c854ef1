"""Tensor-parallel checks on 8 forced host devices, run as a subprocess by tests/distributed/test_parallel.py
and tests/loading/test_checkpoint.py (the device count is fixed when JAX starts, and the rest of the
suite runs on one device). Prints one JSON object of measurements; the tests assert on it.

    python tests/parallel_worker.py tp MODEL_DIR 1,2,pallas_gpu@2,ep@2 [QUANTIZATION]   logits, tokens, shardings, HLO
    python tests/parallel_worker.py checkpoint HF_DIR CKPT_DIR OUT_DIR   sharded orbax round trip
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import functools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from orca_jax import SamplingParams  # noqa: E402
from orca_jax.engine.engine import LLMEngine  # noqa: E402
from orca_jax.worker.runner import ModelRunner  # noqa: E402

# One token bucket (16) and no warm-up: one program per engine, its step keeping the logits.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16, page_size=8, num_pages=32,
              max_model_len=128, warmup=False, make_runner=functools.partial(ModelRunner, keep_logits=True),
              async_scheduling=False)  # drive_logits reads each call's step; overlapped runs give the same tokens
PROMPT_LENGTHS = (5, 19, 11)  # 19 > 16: chunked prefill next to decodes


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=n).tolist() for n in PROMPT_LENGTHS]


def drive_logits(engine: LLMEngine, max_tokens: int = 4) -> tuple[list[np.ndarray], list[list[int]]]:
    """Greedy generation through engine.step(): every step's logits rows of the scheduled
    sequences (the engine's runner keeps them), and the tokens generated."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts(engine.model_config.vocab_size)):
        engine.add_request(f"r{i}", p, params)
    seqs = [engine.requests[f"r{i}"].seqs[0] for i in range(len(PROMPT_LENGTHS))]
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        steps.append(engine.last_step.output.logits[: len(engine.last_step.scheduled)])
    return steps, [list(s.output_token_ids) for s in seqs]


def generate(engine: LLMEngine) -> list[list[int]]:
    """Through the compiled step (sampling on device): greedy and seeded random requests."""
    vocab = engine.model_config.vocab_size
    kinds = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
             SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=6, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, repetition_penalty=1.3)]
    for i, (p, params) in enumerate(zip(prompts(vocab), kinds)):
        engine.add_request(f"g{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"g{i}"] for i in range(len(kinds))]


def collectives(hlo: str) -> dict:
    """All-reduces by the operation they follow (from XLA's op_name metadata), and the shapes
    that all-gathers produce."""
    # An all-reduce of several arrays (XLA combines neighbours) has a tuple type: "(f32[..], f32[..])".
    reduces = re.findall(r"= (?:\([^)]*\)|\S+) all-reduce\(.*?op_name=\"([^\"]+)\"", hlo)
    return {
        "all_reduce_total": len(reduces),
        "all_reduce_o_proj": sum("o_proj" in r for r in reduces),
        "all_reduce_mlp_out": sum(("down_proj" in r or "mlp/proj" in r) for r in reduces),
        "all_reduce_moe": sum("moe" in r and "psum" in r for r in reduces),  # the experts' shard_map psum
        "all_reduce_embed": sum("gather" in r and "layers" not in r for r in reduces),
        "all_gather_shapes": re.findall(r"= (\S+) all-gather\(", hlo),
        "all_to_all": len(re.findall(r" all-to-all\(", hlo)),
        # The layer scan is one while loop: collectives inside it run once per layer.
        "in_layer_loop": len([r for r in reduces if "/while/body/" in r]),
    }


def tp_run(model_dir: str, sizes: list[str], quantization: str | None = None) -> dict:
    """`sizes`: "1", "2", ... or "IMPL@N" (attention implementation IMPL at size N), where IMPL
    "ep" is expert parallelism (a mixture of experts' experts whole per device) with the
    reference attention. The first is the reference for the logits. `quantization`: every
    run's weights quantized so."""
    results, reference = {}, None
    for run in sizes:
        impl, _, tp = run.rpartition("@")
        tp = int(tp)
        expert_parallel = impl == "ep"
        impl = "reference" if expert_parallel or not impl else impl
        engine = LLMEngine(model=model_dir, tensor_parallel_size=tp, attention_impl=impl,
                           enable_expert_parallel=expert_parallel, quantization=quantization, **ENGINE)
        logits, greedy = drive_logits(engine)
        tokens = generate(engine)
        result = {"greedy": greedy, "sampled": tokens}
        if reference is None:
            reference = logits
        result["max_logit_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(logits, reference))
        result["steps"] = len(logits)
        if tp > 1:
            runner = engine.runner
            cache = runner.kv_cache
            result["kv_spec"] = str(cache.sharding.spec)
            result["kv_shape"] = list(cache.shape)
            result["kv_shard_shapes"] = sorted({str(s.data.shape) for s in cache.addressable_shards})
            result["kv_devices"] = len(cache.sharding.device_set)
            attn = runner.params["params"]["layers"]["attn"]
            if "moe" in runner.params["params"]["layers"]:
                moe = runner.params["params"]["layers"]["moe"]
                # Float experts, or packed ones (gpt-oss's MXFP4: codes and scales beside them).
                names = [n for n in ("router", "gate_proj", "down_proj", "gate_proj_blocks", "down_proj_blocks",
                                     "down_proj_scales", "down_bias") if n in moe]
                result["moe_specs"] = {name: str(moe[name].sharding.spec) for name in names}
                result["moe_shard_shapes"] = {name: list(moe[name].addressable_shards[0].data.shape)
                                              for name in names if name not in ("router", "down_bias")}
            result["param_specs"] = {
                "q_proj": str(attn["q_proj"]["kernel"].sharding.spec),
                "k_proj": str(attn["k_proj"]["kernel"].sharding.spec),
                "o_proj": str(attn["o_proj"]["kernel"].sharding.spec),
                "embed": str(runner.params["params"]["embed"].sharding.spec),
            }
            if quantization is not None:  # scales shard with their weights' output channels
                specs = {f"{name}_qscale": str(attn[name]["qscale"].sharding.spec) for name in ("q_proj", "k_proj", "o_proj")}
                specs["embed_qscale"] = str(runner.params["params"]["embed_qscale"].sharding.spec)
                specs["q_proj_dtype"] = str(attn["q_proj"]["kernel"].dtype)
                result["quantized_specs"] = specs
            result["kv_heads_stored"] = runner.model_config.num_kv_heads
            program = runner._programs[ENGINE["max_num_batched_tokens"]]
            result["hlo"] = collectives(program.as_text())
        results[run] = result
    return results


def checkpoint_run(hf_dir: str, ckpt_dir: str, out_dir: str) -> dict:
    """A checkpoint converted on one device, restored onto meshes of 2 and 4 (KV heads
    replicated 2x at 4); and one converted sharded over 4 devices, restored on one."""
    from orca_jax.loading import checkpoint
    from orca_jax.distributed import parallel
    from orca_jax.loading.convert import convert
    from orca_jax.models import logical_specs
    from orca_jax.loading.loader import load_model

    def equal(restored, expected) -> bool:
        a, b = parallel.tree_paths(restored), parallel.tree_paths(expected)
        return a.keys() == b.keys() and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)

    loaded = load_model(hf_dir)
    opened = checkpoint.open_checkpoint(ckpt_dir)
    out = {}
    for tp in (2, 4):
        repeats = parallel.kv_head_repeats(loaded.config, tp)
        restored = opened.restore("float32", parallel.make_mesh(tp), kv_head_repeats=repeats)
        expected = parallel.repeat_kv_heads(jax.tree.map(np.copy, loaded.params), logical_specs(loaded.config), repeats)
        attn = restored["params"]["layers"]["attn"]
        out[str(tp)] = {
            "equal": equal(restored, expected),
            "q_spec": str(attn["q_proj"]["kernel"].sharding.spec),
            "k_spec": str(attn["k_proj"]["kernel"].sharding.spec),
            "k_shard_shape": list(attn["k_proj"]["kernel"].addressable_shards[0].data.shape),
            "devices": len(attn["q_proj"]["kernel"].sharding.device_set),
        }
    convert(hf_dir, out_dir, tensor_parallel_size=4)
    out["sharded_save_restored_whole_equal"] = equal(checkpoint.open_checkpoint(out_dir).restore(), loaded.params)
    # The engine on the checkpoint at tensor_parallel_size 4 generates what the HF directory
    # does on one device.
    runs = {}
    for name, model, tp in (("hf_tp1", hf_dir, 1), ("ckpt_tp4", ckpt_dir, 4)):
        engine = LLMEngine(model=model, tensor_parallel_size=tp, **ENGINE)
        runs[name] = generate(engine)
    out["generate_equal"] = runs["hf_tp1"] == runs["ckpt_tp4"]
    return out


def main() -> None:
    mode, *args = sys.argv[1:]
    assert jax.device_count() == 8, jax.devices()
    if mode == "tp":
        result = tp_run(args[0], args[1].split(","), *args[2:])
    else:
        result = checkpoint_run(*args)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
