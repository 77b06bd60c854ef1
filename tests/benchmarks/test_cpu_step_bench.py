"""benchmarks/cpu_step_bench.py: its hand-built steps are the steps they claim to be (through
the step program's own `expand`), its byte and FLOP accounting is what its docstring says, and
a run at tiny sizes on a tiny random model writes every row of every part."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from orca_jax.worker.batch_state import create_device_state, create_token_counts, expand
from orca_jax.bench.random_model import write_random_checkpoint
from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.kernels import resolve_impl

TINY = dict(model_type="llama", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=8192, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("cpu_step_bench")


def engine_config(max_num_seqs=4, budget=16, max_model_len=64) -> EngineConfig:
    model = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=4, max_position_embeddings=4096)
    return EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                        page_size=16, num_pages=100).resolve(model)


def expanded(config, inputs, page_table=None):
    """The step program's view of `inputs`: (Batch, tokens that found no token)."""
    state = create_device_state(config, create_token_counts(config, 100))
    if page_table is not None:  # the pages earlier steps would have sent
        state = dataclasses.replace(state, page_table=jax.numpy.asarray(page_table))
    _, batch, _, unresolved = jax.jit(expand, static_argnums=2)(state, inputs, config.page_size)
    return jax.tree.map(np.asarray, batch), int(unresolved)


def test_decode_step_visits_every_sequences_own_context(bench):
    config = engine_config()
    batch_size, context = 3, 40  # not a whole number of pages: the last page is part-filled
    table = bench.decode_page_table(config, batch_size, context)
    batch, unresolved = expanded(config, bench.decode_inputs(config, 100, batch_size, context), table)
    meta = batch.metadata
    assert unresolved == 0
    assert list(meta.kv_lens[:batch_size]) == [context] * batch_size and not meta.kv_lens[batch_size:].any()
    assert list(meta.positions[:batch_size]) == [context - 1] * batch_size
    assert list(meta.cu_q_lens[:batch_size + 1]) == [0, 1, 2, 3] and int(meta.num_seqs[0]) == batch_size
    # Each sequence holds ceil(40 / 16) = 3 pages of its own, none of them the padding page 0.
    owned = meta.page_table[:batch_size, :3]
    assert len(set(owned.ravel().tolist())) == 9 and 0 not in owned and not meta.page_table[:, 3:].any()
    # Its new token's K/V goes to offset 39 % 16 = 7 of its own third page.
    assert list(meta.slot_mapping[:batch_size]) == [p * 16 + 7 for p in owned[:, 2]]
    assert (batch.sampling.temperature == 0).all()  # greedy rows


def test_prefill_step_joins_and_brings_its_pages(bench):
    config = engine_config(budget=32)
    batch, unresolved = expanded(config, bench.prefill_inputs(config, 100, 21))
    meta = batch.metadata
    assert unresolved == 0 and batch.input_ids.shape == (32,)  # padded to the 32-token bucket
    assert int(meta.kv_lens[0]) == 21 and list(meta.positions[:21]) == list(range(21))
    assert list(meta.page_table[0, :2]) == [1, 2] and not meta.page_table[0, 2:].any()
    assert int(batch.logits_indices[0]) == 20


def test_byte_and_flop_accounting(bench):
    c = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=3, num_heads=2, num_kv_heads=1,
                    head_dim=2)
    assert bench.kv_bytes_per_token(c, "float32") == 3 * 2 * 1 * 2 * 4
    assert bench.kv_bytes_per_token(c, "bfloat16") == 3 * 2 * 1 * 2 * 2
    layers = {"kernel": np.zeros((3, 4, 6), np.float32)}
    tied = {"params": {"embed": np.zeros((10, 4), np.float32), "layers": layers}}
    untied = {"params": {**tied["params"], "lm_head": np.zeros((4, 10), np.float32)}}
    # A tied embedding is read once, as the LM head; an untied table is only looked up.
    assert bench.weight_bytes(tied) == (40 + 72) * 4
    assert bench.weight_bytes(untied) == (72 + 40) * 4
    flops = bench.prefill_flops(c, {"layer_matmul": 100}, tokens=3)
    assert flops["linear"] == 2 * 100 * 3 and flops["lm_head"] == 2 * 10 * 4
    assert flops["attention"] == 4 * 3 * 2 * 2 * (1 + 2 + 3)
    assert flops["total"] == flops["linear"] + flops["lm_head"] + flops["attention"]


def test_sampler_mixes_set_all_rows_or_the_first(bench):
    one = bench.sampler_inputs("one_top_p_0.9", 4)
    assert list(one.top_p) == pytest.approx([0.9, 1, 1, 1]) and list(one.temperature) == [1, 0, 0, 0]
    every = bench.sampler_inputs("top_k_50", 4)
    assert list(every.top_k) == [50] * 4 and (every.temperature == 1).all()
    greedy = bench.sampler_inputs("greedy", 4)
    assert (greedy.temperature == 0).all() and not greedy.want_logprobs.any()
    assert list(bench.sampler_inputs("one_logprobs_5", 3).want_logprobs) == [True, False, False]


@pytest.mark.parametrize("argv,message", [(["--attention-impl", "nope"], "invalid choice"),
                                          (["--parts", "decode,nope"], "choose from decode, prefill, sampler"),
                                          (["--batch-sizes", "0"], "positive integers"),
                                          (["--repeats", "0"], "--repeats must be >= 1")])
def test_bad_arguments_are_refused(bench, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_tiny_run_writes_every_row(bench, tmp_path):
    model = write_random_checkpoint(tmp_path / "tiny", TINY, "float32")
    out = tmp_path / "out.json"
    # bfloat16 weights over a float32 cache: both byte counts follow their own dtype.
    argv = ["--model", str(model), "--dtype", "bfloat16", "--kv-cache-dtype", "float32", "--batch-sizes", "1,2", "--contexts", "16,40",
            "--prefill-tokens", "8", "--sampler-rows", "3", "--vocab-size", "700", "--logit-scales", "3", "--repeats", "1",
            "--bandwidth-mib", "4", "--matmul-size", "64", "--json", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    machine = report["machine"]
    assert machine["orca_jax"]["path"] and isinstance(machine["cpu_flags"], list) and report["benchmark"] == "cpu_step_bench"
    assert report["read_bandwidth"]["gb_per_s"] > 0 and report["matmul"]["roofline_flop_per_s"] > 0
    rows = report["rows"]

    decode = [r for r in rows if r["part"] == "decode"]
    assert [(r["batch"], r["context"]) for r in decode] == [(1, 16), (2, 16), (1, 40), (2, 40)]
    D, F, V, L = 32, 64, 512, 2
    per_layer = D * (4 * 8 + 2 * 2 * 8) + 4 * 8 * D + 3 * D * F + 2 * D
    for r in decode:
        assert (r["dtype"], r["kv_dtype"]) == ("bfloat16", "float32")
        assert r["weight_bytes"] == 2 * (L * per_layer + D + V * D)  # untied: the LM head, not the table
        assert r["kv_bytes"] == r["batch"] * r["context"] * L * 2 * 2 * 8 * 4
        assert r["step_ms"] > 0 and r["attention_ms"] > 0 and r["attention_impl"] == resolve_impl("auto")
        assert r["share_of_roofline"] == pytest.approx(r["roofline_ms"] / r["step_ms"])
        assert r["attention_share"] == pytest.approx(r["attention_ms"] / r["step_ms"])

    (prefill,) = [r for r in rows if r["part"] == "prefill"]
    assert prefill["tokens"] == 8 and prefill["step_ms"] > 0 and prefill["kv_dtype"] == "float32"
    assert prefill["flop_per_s_used"] >= report["matmul"]["flop_per_s"]["jax_bfloat16"]
    assert prefill["flops"]["attention"] == 4 * L * 4 * 8 * (8 * 9 // 2)

    sampler = [r for r in rows if r["part"] == "sampler"]
    assert [r["mix"] for r in sampler] == list(bench.SAMPLER_MIXES)
    assert all(r["rows"] == 3 and r["vocab_size"] == 700 and r["logit_scale"] == 3 and r["ms"] > 0 for r in sampler)
