"""`bench quant` end to end (`--quick`) on a tiny random Llama written here as a GGUF file with
Q8_0 matrices (so every configuration, the GGUF blocks included, loads the same weights): the
record's structure, the memory invariants that quantization must keep (int8 weights about half
of bfloat16's, an int8 KV pool about twice the tokens of bfloat16's for the same bytes, the
bytes per token counting the scales), decode runs by turns with ratios to float32, greedy
agreement, and the idle memory of two real `orca-jax serve` processes."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from orca_jax import cli
from orca_jax.bench.environment import cpu_flags
from orca_jax.bench.quant import CONFIGS, DEFAULT_CONFIGS, QuantSettings, agreement, turn_order

# head_dim 64 as in the models that matter (an 8-bit row of 64 values + 2 scale bytes is 66 bytes
# against 128 in bfloat16); contractions of 128 and 256 (multiples of GGUF's 32-blocks).
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 128, 2, 1, 64, 256, 2


def _write_tokenizer(writer) -> int:
    """Byte-level vocabulary: the 256 byte symbols, two merges, <s> and </s>. Returns its size."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "<s>", "</s>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(False)
    return len(tokens)


def write_tiny_q8_gguf(path: Path, seed: int = 0) -> Path:
    """A random two-layer Llama GGUF (tied embeddings), its matrices Q8_0, norms F32."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    vocab = _write_tokenizer(writer)

    def add(name: str, w: np.ndarray) -> None:
        if w.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, w)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    add("token_embd.weight", w(vocab, HIDDEN))
    add("output_norm.weight", 1 + w(HIDDEN))
    for i in range(LAYERS):
        for name, shape in [("attn_norm", (HIDDEN,)), ("ffn_norm", (HIDDEN,)), ("attn_q", (HEADS * HEAD_DIM, HIDDEN)),
                            ("attn_k", (KV_HEADS * HEAD_DIM, HIDDEN)), ("attn_v", (KV_HEADS * HEAD_DIM, HIDDEN)),
                            ("attn_output", (HIDDEN, HEADS * HEAD_DIM)), ("ffn_gate", (FFN, HIDDEN)),
                            ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN))]:
            add(f"blk.{i}.{name}.weight", w(*shape) + (1 if "norm" in name else 0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_q8_gguf(tmp_path_factory) -> Path:
    return write_tiny_q8_gguf(tmp_path_factory.mktemp("tiny-q8") / "tiny-q8.gguf")


def test_settings_and_helpers():
    assert list(DEFAULT_CONFIGS) == ["float32", "bfloat16", "bf16+kv_bf16", "int8", "gguf", "kv_int8", "int8+kv_int8"]
    assert CONFIGS["bf16+kv_bf16"]["kv_cache_dtype"] == "bfloat16", "the memory baseline is a bfloat16 cache too"
    assert "kv_cache_dtype" not in CONFIGS["bfloat16"], "timed as LLM(dtype='bfloat16') runs on CPU"
    assert turn_order(["a", "b", "c"], 0) == ["a", "b", "c"] and turn_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert agreement([[1, 2, 3, 4], [1, 2, 9, 9]], [[1, 2, 3, 4], [1, 2, 3, 4]], 3) == {
        "tokens": 3, "requests": 2, "identical": 1, "mean_common_prefix": 2.5}
    with pytest.raises(ValueError, match="configs"):
        QuantSettings(configs=("float32", "int4"))
    with pytest.raises(ValueError, match="serve configs"):
        QuantSettings(serve_configs=("float32", "fp16"))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        QuantSettings(batch_sizes=(1, 64), max_num_batched_tokens=32)
    engine = QuantSettings().engine_args("int8+kv_int8")
    assert engine["quantization"] == "int8" and engine["kv_cache_dtype"] == "int8"
    assert engine["kv_cache_memory_bytes"] == 256 << 20 and engine["enable_prefix_caching"] is False
    assert all(flag.startswith(("avx", "amx", "fma", "f16c", "vnni")) for flag in cpu_flags())


def test_bench_quant_quick_on_a_tiny_gguf(tiny_q8_gguf, tmp_path, capsys):
    out = tmp_path / "quant.json"
    code = cli.main(["bench", "quant", "--quick", "--model", str(tiny_q8_gguf), "--out", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    s = record["settings"]
    labels = ["float32", "bf16+kv_bf16", "int8+kv_int8", "gguf"]
    timed = ["float32", "int8+kv_int8", "gguf"]
    assert record["skipped"] == {} and list(record["results"]) == labels == s["configs"]
    r = record["results"]
    for label in labels:
        res = r[label]
        assert res["pool_tokens"] == res["num_pages"] * res["page_size"]
        assert not res["pool_capped_by_page_tables"], label
        # The bytes per token count what the cache allocates (an 8-bit row's scale included).
        assert res["kv_bytes_per_token"] == res["kv_bytes_per_token_allocated"]
        assert res["kv_cache_bytes"] <= s["kv_cache_memory_bytes"]
        assert res["timed"] == (label in timed)
        if not res["timed"]:  # the memory baseline: one short probe, then shut down
            assert res["decode_probe"]["decode_tokens"] > 0 and "decode" not in res
            continue
        for batch in ("1", "2"):
            d = res["decode"][batch]
            assert d["decode_tok_per_s"] > 0 and len(d["ratio_to_float32_by_round"]) == s["rounds"]
        assert res["offline"]["useful_output_tokens_per_s"] > 0
    # Memory: what quantization is for.
    rows = 2 * LAYERS * KV_HEADS  # K and V rows per token
    assert r["float32"]["kv_bytes_per_token"] == r["gguf"]["kv_bytes_per_token"] == rows * HEAD_DIM * 4
    assert r["bf16+kv_bf16"]["kv_bytes_per_token"] == rows * HEAD_DIM * 2
    assert r["int8+kv_int8"]["kv_bytes_per_token"] == rows * (HEAD_DIM + 2)  # int8 values + a bfloat16 scale
    assert r["int8+kv_int8"]["kv_dtype"] == "int8" and r["int8+kv_int8"]["quantization"] == "int8"
    assert r["gguf"]["quantization"] == "gguf" and r["float32"]["quantization"] is None
    assert r["int8+kv_int8"]["weight_ratio_to_bfloat16"] < 0.55
    assert r["gguf"]["weight_ratio_to_bfloat16"] < 0.6  # Q8_0: int8 + a float16 scale and offset per 32
    assert r["float32"]["weight_ratio_to_bfloat16"] == pytest.approx(2.0, rel=1e-6)
    assert r["int8+kv_int8"]["kv_tokens_ratio_to_bfloat16"] > 1.9
    assert r["float32"]["kv_tokens_ratio_to_bfloat16"] < 0.55
    # Decode by turns: every configuration every round, ratios to float32's run of the same round.
    runs = record["decode_runs"]
    assert len(runs) == s["rounds"] * 2 * len(timed)
    first = [run["config"] for run in runs if (run["round"], run["batch"]) == (0, 1)]
    assert first == timed, "runs are listed in label order"
    for run in runs:
        assert run["xla_compiles_during_run"] == 0 and run["decode_tokens"] > 0
        if run["config"] == "float32":
            assert run["ratio_to_float32"] == 1.0
            assert run["agreement_with_float32"]["identical"] == run["batch"]
    # Greedy float32 agrees with itself in every round.
    assert r["float32"]["decode"]["2"]["agreement_identical_every_round"]
    assert len(record["offline_runs"]) == len(timed) and record["xla_compiles_during_runs"] == 0
    # Targets: evaluated where measured (int8 weights alone are not among the quick configs).
    t = record["targets"]
    assert t["weight_ratio_int8"]["met"] is True and set(t["weight_ratio_int8"]["by_config"]) == {"int8+kv_int8"}
    assert t["kv_tokens_ratio_int8"]["met"] is True
    assert t["int8_speed_batch1"] == {"measured": False, "met": None, "limit": 1.0}
    # Two idle servers, started at once.
    serve = record["serve_idle"]
    assert set(serve) == {"float32", "int8+kv_int8"}
    for label, res in serve.items():
        assert "error" not in res, res
        assert res["rss_bytes"] > 50 << 20 and res["peak_rss_bytes"] >= res["rss_bytes"]
        assert res["kv"]["num_pages"] >= 2 and res["ready_s"] > 0
    assert serve["int8+kv_int8"]["args"][-4:] == ["--quantization", "int8", "--kv-cache-dtype", "int8"]
    assert serve["int8+kv_int8"]["kv"]["kv_cache_mib"] < serve["float32"]["kv"]["kv_cache_mib"]
    m = record["machine"]
    assert m["jax"] and isinstance(m["cpu_flags"], list) and record["load_average"]["start"] is not None
    assert record["command"].startswith("orca-jax bench quant --model")
    printed = capsys.readouterr().out
    assert "| int8+kv_int8 |" in printed and "target: int8 KV pool >= 1.9x bfloat16's tokens: MET" in printed


def test_serve_only_starts_the_servers_one_after_another_and_builds_no_engine(tmp_path, monkeypatch, capsys):
    """`--serve-only`: the idle servers alone (the repeat of the idle-memory table), each server
    with its own flags, the equal-pages one after float32 with float32's page count; no engine
    in the bench's process. Servers faked: their start is what test_bench_quant_quick checks."""
    from orca_jax.bench import quant

    started, alive = [], []

    class FakeServer:
        def __init__(self, model, args):
            self.command = ["python", "-m", "orca_jax.cli", "serve", "--port", "0", *args]
            started.append(tuple(args))
            alive.append(self)
            pages = int(args[args.index("--num-pages") + 1]) if "--num-pages" in args else (
                400 if "--kv-cache-dtype" in args else 100)
            self.kv = {"num_pages": pages, "page_size": 16, "sequence_tokens": pages * 16 - 16, "kv_cache_mib": 1.0}
            self.ready_line = "engine ready in 1.0 s"

        def wait_ready(self, timeout_s):
            assert alive == [self], "one server at a time"
            return 1.0

        def memory(self):
            return {"rss_bytes": (2 << 30) if self.command[-1:] == ["0"] else (1 << 30), "peak_rss_bytes": 3 << 30}

        def stop(self):
            alive.remove(self)

    monkeypatch.setattr(quant, "ServeProcess", FakeServer)
    monkeypatch.setattr(quant, "build", lambda *a, **k: pytest.fail("serve-only builds no engine"))
    out = tmp_path / "serve.json"
    code = cli.main(["bench", "quant", "--serve-only", "--settle", "0", "--serve-configs",
                     "float32,int8,kv_int8,int8+kv_int8@float32_pages", "--out", str(out)])
    assert code == 0
    assert started == [(), ("--quantization", "int8"), ("--kv-cache-dtype", "int8"),
                       ("--quantization", "int8", "--kv-cache-dtype", "int8", "--num-pages", "100")]
    record = json.loads(out.read_text())
    assert record["benchmark"] == "quant_serve" and "--serve-only" in record["command"]
    idle = record["serve_idle"]
    assert list(idle) == ["float32", "int8", "kv_int8", "int8+kv_int8@float32_pages"]
    assert idle["float32"]["rss_ratio_to_float32"] == 1.0 and idle["int8"]["rss_ratio_to_float32"] == 0.5
    assert idle["kv_int8"]["kv"]["num_pages"] == 400 and idle["int8+kv_int8@float32_pages"]["kv"]["num_pages"] == 100
    assert "| kv_int8 | --kv-cache-dtype int8 | 1.00 | 0.50 |" in capsys.readouterr().out
