"""GGUF files of the Llama-block families (llama, mistral, qwen2, qwen3) against the transformers
models they were converted from.

Each tiny random HF model is written to GGUF here the way llama.cpp's convert_hf_to_gguf.py
writes it: tensor names from gguf-py's own `TensorNameMap` (what the converter maps with), the
metadata keys `TextModel.set_gguf_parameters` writes (plus `LlamaModel`'s vocab size and RoPE
dimensions), and Q/K rows permuted (`LlamaModel.permute`) for the "llama" architecture only,
which is also what Mistral is written as; Qwen2/Qwen3 (NEOX RoPE) are written unpermuted. The
file is loaded with `load_model` and its parameter tree compared with the HF weights (exactly).
Logits are compared with HF's within ATOL three ways: every F32 file's model runs a few ragged
prompts in one prefill with logits at every position (one compiled program per family, so the
file stays quick on 2 cores), the Q8_0 file runs through the engine
(`drive_engine_against_hf`: chunked prefill, mixed steps, a late arrival), against HF holding
the file's dequantized weights, and so does a file of Q4_1, Q4_0 and Q8_0 blocks with
quantization="gguf", whose blocks (with Q4_1's nonzero offsets) are dequantized in the step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
import torch

from orca_jax.kernels import quantization
from orca_jax.models import config_from_hf
from orca_jax.models.layers import model_rope_tables
from orca_jax.loading import gguf_arch
from orca_jax.loading.gguf_tokenizer import build_tokenizer
from orca_jax.models.llama import LlamaForCausalLM
from orca_jax.loading.loader import SUPPORTED_GGUF_ARCHITECTURES, gguf_config, hf_to_params, load_model

ATOL = 1e-4  # F32 logits; the Q8_0 case is held to the same bound against its dequantized weights
MISTRAL_WINDOW = 12  # below most sequence lengths of the parity run, not a multiple of the page size
VOCAB = 512

# family -> (transformers config class, settings, randomise biases, GGUF architecture). The Qwen2,
# Qwen3 and Mistral settings are test_model_families.py's, so a full run makes each HF model once.
FAMILIES = {
    # GQA 4:2, untied head.
    "llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=256, tie_word_embeddings=False,
                                  initializer_range=0.1), False, "llama"),
    # GQA 4:1 and a sliding window (see test_mistral_window_is_read_from_the_file_only).
    "mistral": ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=256, sliding_window=MISTRAL_WINDOW,
                                      initializer_range=0.1), False, "llama"),
    # Random Q/K/V biases, tied head, GQA 4:2.
    "qwen2": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  tie_word_embeddings=True, initializer_range=0.1), True, "qwen2"),
    # q_norm/k_norm; head_dim 32, so heads * head_dim (128) != hidden (64).
    "qwen3": ("Qwen3Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  max_position_embeddings=256, initializer_range=0.1), False, "qwen3"),
    # Gemma 2 as llama.cpp reads it: alternating windows, both soft caps, 1 + w norms,
    # query_pre_attn_scalar = head_dim (every release but the 27B; gguf_arch.py).
    "gemma2": ("Gemma2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    query_pre_attn_scalar=16, sliding_window=MISTRAL_WINDOW,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                    max_position_embeddings=256, initializer_range=0.1), False, "gemma2"),
    # Gemma 3: llama.cpp's fixed 5 sliding : 1 full at local base 10000, Q/K norms, linear
    # scaling on the full layer.
    "gemma3_text": ("Gemma3TextConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                             query_pre_attn_scalar=16, sliding_window=MISTRAL_WINDOW,
                                             sliding_window_pattern=6, rope_local_base_freq=10000.0,
                                             rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 4.0},
                                             max_position_embeddings=256, initializer_range=0.1), False, "gemma3"),
    # Phi-3: fused qkv_proj / gate_up_proj, partial rotary, LongRoPE (factors as tensors), a
    # window on every layer.
    "phi3": ("Phi3Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=256, sliding_window=MISTRAL_WINDOW,
                                partial_rotary_factor=0.5, original_max_position_embeddings=64, pad_token_id=0,
                                rope_scaling={"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0],
                                              "long_factor": [1.0, 2.0, 4.0, 8.0]},
                                initializer_range=0.1), False, "phi3"),
}
# Families whose norms llama.cpp's converter stores as 1 + w (gguf_arch.norm_offset).
NORM_OFFSET = {"gemma2": 1.0, "gemma3": 1.0}
# Every F32 file, and the Q8_0 files (qwen2's the engine runs; the new architectures' run a prefill).
FILES = [(name, "F32") for name in FAMILIES] + [("qwen2", "Q8_0"), ("gemma3_text", "Q8_0"), ("phi3", "Q8_0")]
# The file run with quantization="gguf" (blocks kept, dequantized inside the step): qwen2 (its
# embedding is also its head) with llama.cpp's three block types, each on two or more matrices.
# Q4_1 blocks carry an offset (their minimum), so the embedding's and three layers' offsets are
# nonzero; Q4_0 blocks on a 16-level grid keep one too (-8 steps), the rest become int8.
BLOCK_TYPES = {"embed_tokens": "Q4_1", "q_proj": "Q4_1", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q4_1",
               "gate_proj": "Q4_0", "up_proj": "Q8_0", "down_proj": "Q4_1"}
# One ragged prefill per family; 31 tokens reach past the Mistral window.
PROMPT_LENGTHS = (5, 23, 31)

# Text for the Qwen-style tokenizer: contractions, digit runs, code, special tokens.
_QWEN_CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and we'll see 12345 items.",
    "def add(a, b):\n    return a + b  # x.y_z\n\nprint(add(3, 4))\n",
    "Qwen splits every digit: 3.14159, 1,000,000 and 0x1F; don't, I'm, they've, we'd.",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n391<|im_end|>\n",
] * 30
_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# PyTorch is the reference here; run it single-threaded (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("torch_single_thread")


# ---------------------------------------------------------------------------------------------
# Writing GGUF files as llama.cpp's converter does
# ---------------------------------------------------------------------------------------------
def _hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """`LlamaModel.permute` of convert_hf_to_gguf.py: each head's [first half, second half] rows
    become interleaved pairs, for llama.cpp's NORM RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def inverse_permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_metadata(writer, config, arch: str, qtype) -> None:
    """The keys `TextModel.set_gguf_parameters` writes for these configs; `LlamaModel` adds the
    vocabulary size and RoPE dimensions. key_length only where the config names a head_dim
    (Qwen2's has none: hidden / heads)."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3's by layer type: the base of the global layers
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = config.to_dict().get("head_dim")
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    # A file of mixed types, as llama.cpp's own (Q4_K_M, ...), is named after its main one.
    main_type = qtype if isinstance(qtype, str) else max(qtype.values(), key=list(qtype.values()).count)
    writer.add_file_type(gguf.LlamaFileType[{"F32": "ALL_F32"}.get(main_type, f"MOSTLY_{main_type}")])
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.head_dim)
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3":  # Gemma3Model: the window, the global layers' linear scaling (TextModel)
        writer.add_sliding_window(config.sliding_window)
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":  # Phi3MiniModel: rotary dimensions, the original context, window 0 for none
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size)
                                        // config.num_attention_heads)
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
        scale = config.max_position_embeddings / config.original_max_position_embeddings
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(
            config.original_max_position_embeddings)) if scale > 1.0 else 1.0)


def _write_extra_tensors(writer, config, arch: str) -> None:
    """Phi3MiniModel.generate_extra_tensors: LongRoPE's factors as float32 tensors."""
    rope = config.rope_parameters
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))


def _write_tokenizer(writer, tokenizer: dict) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer["pre"])
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer["types"])
    writer.add_token_merges(tokenizer["merges"])
    writer.add_eos_token_id(tokenizer["eos"])


def tensor_type(qtype: str | dict[str, str], name: str, w: np.ndarray) -> str:
    """The GGML type a tensor of the HF model is written in: vectors (norms, biases) stay F32, as
    in llama.cpp; matrices take `qtype`, or with a mapping the type of their module ("q_proj",
    "embed_tokens", ...: llama.cpp's mixed files, e.g. Q4_K_M, keep some matrices finer)."""
    if w.ndim != 2:
        return "F32"
    return qtype if isinstance(qtype, str) else qtype[name.split(".")[-2]]


def write_gguf(path: Path, hf_model, arch: str, tokenizer: dict, qtype: str | dict[str, str] = "F32",
               window: int | None = None) -> dict[str, np.ndarray]:
    """Write `hf_model` as llama.cpp would for `arch`, its matrices in `qtype` (see
    `tensor_type`); `window` adds attention.sliding_window (which the converter itself does
    not write). Returns the weights as the file holds them, dequantized and back in HF names
    and layout."""
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{config.model_type}")
    _write_metadata(writer, config, arch, qtype)
    if window is not None:
        writer.add_sliding_window(window)
    _write_tokenizer(writer, tokenizer)
    _write_extra_tensors(writer, config, arch)
    norm_offset = NORM_OFFSET.get(arch, 0.0)
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], config.num_hidden_layers)
    stored = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied checkpoint's safetensors hold no head, so neither does the file
        w = tensor.detach().float().numpy().copy()
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(name.split(".")[-2])
        permuted = arch == "llama" and heads is not None
        if permuted:
            w = permute_rope_rows(w, heads)
        offset = norm_offset if name.endswith("norm.weight") else 0.0
        w = w + np.float32(offset)  # Gemma's 1 + w (a no-op elsewhere)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        kind = tensor_type(qtype, name, w)
        if kind != "F32":
            ggml_type = gguf.GGMLQuantizationType[kind]
            quantized = gguf.quants.quantize(w, ggml_type)
            writer.add_tensor(gguf_name, quantized, raw_dtype=ggml_type)
            w = gguf.quants.dequantize(quantized, ggml_type)
        else:
            writer.add_tensor(gguf_name, w)
        w = w - np.float32(offset)  # back to HF's meaning, as the loader reads it
        stored[name] = inverse_permute_rope_rows(w, heads) if permuted else w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


# ---------------------------------------------------------------------------------------------
# Tokenizers: the tiny GPT-2-style one of conftest, and a Qwen-style one
# ---------------------------------------------------------------------------------------------
def _gguf_vocabulary(tokenizer_json: dict, specials: set[int]) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges as the converter stores them (`get_vocab_base`), padded to
    the model's vocabulary with [PADi] (UNUSED)."""
    vocab = dict(tokenizer_json["model"]["vocab"])
    for added in tokenizer_json["added_tokens"]:
        vocab[added["content"]] = added["id"]
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(VOCAB)]
    types = [gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL if i in by_id
             else gguf.TokenType.UNUSED for i in range(VOCAB)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    return tokens, [int(t) for t in types], merges


def gpt2_style_tokenizer_metadata(hf_dir: Path) -> dict:
    """The tiny byte-level BPE saved next to every test model (GPT-2's regex: pre "gpt2")."""
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    specials = {a["id"] for a in data["added_tokens"] if a["special"]}
    tokens, types, merges = _gguf_vocabulary(data, specials)
    return dict(pre="gpt2", tokens=tokens, types=types, merges=merges, eos=2)


def make_qwen_style_tokenizer():
    """A byte-level BPE trained the way Qwen2's tokenizer.json splits text (its own regex from
    transformers, digits one by one, NFC first), with Qwen's special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=_QWEN_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_QWEN_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def qwen_style_tokenizer_metadata(hf_tokenizer) -> dict:
    data = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    specials = {hf_tokenizer.convert_tokens_to_ids(t) for t in _QWEN_SPECIALS}
    tokens, types, merges = _gguf_vocabulary(data, specials)
    return dict(pre="qwen2", tokens=tokens, types=types, merges=merges,
                eos=hf_tokenizer.convert_tokens_to_ids("<|im_end|>"))


# ---------------------------------------------------------------------------------------------
# Fixtures: the HF models, their GGUF files, one engine run per parity case
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_tokenizer():
    return make_qwen_style_tokenizer()


@pytest.fixture(scope="module")
def hf_dirs(tiny_hf_model_factory):
    return {name: tiny_hf_model_factory(cls, seed=1, random_biases=biases, vocab_size=VOCAB, **settings)
            for name, (cls, settings, biases, _) in FAMILIES.items()}


@pytest.fixture(scope="module")
def gguf_files(hf_dirs, qwen_tokenizer, tmp_path_factory):
    """(family, file type) -> (path, the weights it holds in HF layout), for every FILES entry."""
    out = tmp_path_factory.mktemp("gguf-families")
    files = {}
    for name, qtype in FILES:
        arch = FAMILIES[name][3]
        tokenizer = (qwen_style_tokenizer_metadata(qwen_tokenizer) if arch.startswith("qwen")
                     else gpt2_style_tokenizer_metadata(hf_dirs[name]))
        window = MISTRAL_WINDOW if name == "mistral" else None
        path = out / f"{name}-{qtype}.gguf"
        stored = write_gguf(path, _hf_model(hf_dirs[name]), arch, tokenizer, qtype, window)
        files[name, qtype] = path, stored
    return files


def hf_holding(hf_dir: Path, weights: dict[str, np.ndarray]):
    """The HF model of `hf_dir` with `weights` (HF names) loaded in: the reference for a
    quantized file is the model its dequantized weights make."""
    model = _hf_model(hf_dir)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()},
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the head is the embedding
    return model


def model_logits_at_every_position(loaded, prompts: list[list[int]]) -> list[np.ndarray]:
    """All `prompts` prefilled in one step of the loaded model (flat token axis, paged reference
    attention), with logits at every position: one [len(prompt), vocab] array per prompt."""
    import jax.numpy as jnp

    from orca_jax.worker.batch import build_batch
    from orca_jax.config import EngineConfig
    from orca_jax.core.kv_cache import PageAllocator
    from orca_jax.models import architecture
    from orca_jax.core.sampling_params import SamplingParams
    from orca_jax.core.sequence import Sequence

    c, page_size, num_pages = loaded.config, 8, 16
    engine_config = EngineConfig(max_num_seqs=len(prompts), max_num_batched_tokens=64, page_size=page_size,
                                 num_pages=num_pages, max_model_len=64).resolve(c)
    allocator, rows = PageAllocator(num_pages, page_size), []
    for i, prompt in enumerate(prompts):
        seq = Sequence(i, f"r{i}", 0, prompt, SamplingParams(max_tokens=1), 0)
        seq.page_ids = allocator.allocate(-(-len(prompt) // page_size))
        rows.append((seq, len(prompt)))
    batch = build_batch(engine_config, rows)
    every_position = np.arange(len(batch.input_ids), dtype=np.int32)
    kv_cache = jnp.zeros((c.num_layers, num_pages, page_size, 2 * c.num_kv_heads, c.head_dim), jnp.float32)
    model = architecture(c.model_type).model_class(c, "reference", jnp.float32)
    logits, _ = jax.jit(model.apply)(loaded.params, jnp.asarray(batch.input_ids), kv_cache,
                                     jax.tree.map(jnp.asarray, batch.metadata), every_position)
    logits, bounds = np.asarray(logits), np.cumsum([0, *map(len, prompts)])
    return [logits[start:end] for start, end in zip(bounds[:-1], bounds[1:])]


def max_logit_diff_to_hf(path: Path, hf_model, seed: int) -> tuple:
    """(the loaded file, max |logit difference| to `hf_model` over every position of a few
    ragged prompts in one prefill)."""
    loaded = load_model(path)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]
    diff = 0.0
    for prompt, ours in zip(prompts, model_logits_at_every_position(loaded, prompts)):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0].numpy()
        diff = max(diff, float(np.abs(ours - reference).max()))
    return loaded, diff


@pytest.fixture(scope="module")
def forward_results(hf_dirs, gguf_files):
    """family -> (loaded F32 file, max |logit difference| to HF holding the file's weights)."""
    return {name: max_logit_diff_to_hf(gguf_files[name, "F32"][0], hf_holding(hf_dirs[name], gguf_files[name, "F32"][1]), i)
            for i, name in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def q8_engine_result(hf_dirs, gguf_files, engine_parity, make_logits_engine):
    """The Q8_0 file through the engine, against HF holding the file's dequantized weights."""
    path, stored = gguf_files["qwen2", "Q8_0"]
    engine = make_logits_engine(
        model=str(path), warmup=False, page_size=8, max_num_batched_tokens=16, min_token_bucket=16, max_num_seqs=4,
        num_pages=64, max_model_len=128, attention_impl="reference", model_cache_dir=None,
    )
    stats = engine_parity(engine, hf_holding(hf_dirs["qwen2"], stored), np.random.default_rng(7))
    return engine, stats


@pytest.fixture(scope="module")
def block_file(hf_dirs, qwen_tokenizer, tmp_path_factory):
    """The qwen2 model written in BLOCK_TYPES: (path, the weights it holds in HF layout)."""
    path = tmp_path_factory.mktemp("gguf-blocks") / "qwen2-blocks.gguf"
    stored = write_gguf(path, _hf_model(hf_dirs["qwen2"]), "qwen2", qwen_style_tokenizer_metadata(qwen_tokenizer),
                        BLOCK_TYPES)
    return path, stored


def as_gguf_quantization_holds_them(stored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The file's weights as quantization="gguf" keeps them: Q8_0 and Q4_1 blocks exactly; a Q4_0
    block off a 16-level grid re-fitted as int8 (scale amax / 127, within half a step of the
    file's: tests/kernels/test_quantization.py), which numpy's dequantization gives back here."""
    held = {}
    for name, w in stored.items():
        if tensor_type(BLOCK_TYPES, name, w) == "Q4_0":  # HF [out, in]: blocks along in
            q = quantization.quantize_kernel(w.T, num_lead=0, num_contract=1, method="gguf")
            w = quantization.dequantize_kernel_np(q, num_lead=0).T
        held[name] = w
    return held


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FAMILIES))
def test_f32_file_loads_to_the_hf_weights(hf_dirs, gguf_files, name):
    """Exact: no rows left permuted (llama, mistral) and none wrongly unpermuted (qwen2, qwen3
    and the rest), Phi-3's fused projections split where HF's converter splits them. Gemma's
    norms are stored as 1 + w, which float32 rounds: those load to (1 + w) - 1 (the subtraction
    exact), within half an ulp of 1 + w of HF's w, and exactly to what the file holds; every
    other weight is HF's own bit for bit."""
    path, stored = gguf_files[name, "F32"]
    loaded = load_model(path)
    hf = _hf_model(hf_dirs[name])
    expected_config = config_from_hf(json.loads((hf_dirs[name] / "config.json").read_text()))
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    for key, held in stored.items():
        if FAMILIES[name][3] in NORM_OFFSET and key.endswith("norm.weight"):
            rounding = np.spacing(np.float32(1) + np.abs(state[key])) / 2  # of the stored 1 + w
            assert np.all(np.abs(held - state[key]) <= rounding), key
        else:
            np.testing.assert_array_equal(held, state[key], err_msg=key)
    expected = hf_to_params({**state, **stored}, expected_config)
    assert jax.tree.structure(loaded.params) == jax.tree.structure(expected)
    for (leaf, got), want in zip(jax.tree_util.tree_leaves_with_path(loaded.params), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(leaf))
    c = loaded.config
    for field in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
                  "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "sliding_window", "hidden_act", "layer_types",
                  "partial_rotary_factor", "attn_logit_softcapping", "final_logit_softcapping",
                  "query_pre_attn_scalar", "rope_local_theta"):
        assert getattr(c, field) == getattr(expected_config, field), field
    assert c.rms_norm_eps == pytest.approx(expected_config.rms_norm_eps)
    # RoPE as tables: LongRoPE's factors come back through float32 tensors.
    for local in ((False, True) if c.rope_local_theta is not None else (False,)):
        got, want = model_rope_tables(c, local), model_rope_tables(expected_config, local)
        np.testing.assert_allclose(got.inv_freq, want.inv_freq, rtol=1e-6)
        assert got.attention_factor == pytest.approx(want.attention_factor, rel=1e-6)
        assert (got.long_inv_freq is None) == (want.long_inv_freq is None)
        assert got.long_from_position == want.long_from_position


def test_the_switches_each_family_needs(gguf_files):
    configs = {name: load_model(gguf_files[name, "F32"][0]).config for name in FAMILIES}
    assert (configs["llama"].model_type, configs["llama"].sliding_window) == ("llama", None)
    assert (configs["mistral"].model_type, configs["mistral"].sliding_window) == ("mistral", MISTRAL_WINDOW)
    assert configs["qwen2"].qkv_bias and not configs["qwen2"].o_bias and configs["qwen2"].tie_word_embeddings
    assert configs["qwen3"].qk_norm and configs["qwen3"].head_dim == 32 and not configs["qwen3"].qkv_bias
    w = MISTRAL_WINDOW
    assert configs["gemma2"].layer_windows() == (w, None) and configs["gemma2"].attn_logit_softcapping == 5.0
    assert configs["gemma3_text"].layer_windows() == (w,) * 5 + (None,) and configs["gemma3_text"].qk_norm
    assert configs["gemma3_text"].rope_local_theta == 10000.0 and configs["gemma3_text"].rope_theta == 1e6
    assert configs["phi3"].partial_rotary_factor == 0.5 and configs["phi3"].layer_windows() == (w, w)
    assert dict(configs["phi3"].rope_scaling)["rope_type"] == "longrope"


def test_transformers_reads_the_qwen2_file_unpermuted(hf_dirs, gguf_files):
    """An independent reader of the same file: transformers undoes the permutation for "llama"
    files only, and gets the HF weights back from the qwen2 file, so its rows are HF's own."""
    from transformers import AutoModelForCausalLM

    path = gguf_files["qwen2", "F32"][0]
    from_gguf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    reference = _hf_model(hf_dirs["qwen2"]).state_dict()
    for name, value in from_gguf.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), reference[name].numpy(), err_msg=name)


def test_unpermuting_a_qwen_file_would_break_it(gguf_files, monkeypatch):
    """Guards the test above and the parity below: the permutation is not a no-op on these
    shapes, so treating qwen2 rows as llama's would change the weights."""
    path = gguf_files["qwen2", "F32"][0]
    right = load_model(path).params["params"]["layers"]["attn"]["q_proj"]
    monkeypatch.setattr(gguf_arch, "rope_rows_permuted", lambda meta: True)
    wrong = load_model(path).params["params"]["layers"]["attn"]["q_proj"]
    assert not np.array_equal(right["kernel"], wrong["kernel"]) and not np.array_equal(right["bias"], wrong["bias"])


# ---------------------------------------------------------------------------------------------
# Logits
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FAMILIES))
def test_f32_logits_match_transformers_at_every_position(forward_results, name):
    loaded, diff = forward_results[name]
    print(f"{name} F32: max |logit diff| = {diff:.3e} over {sum(PROMPT_LENGTHS)} positions")
    assert diff <= ATOL, f"{name}: max abs logit difference {diff:.3e} > {ATOL}"
    assert loaded.config.model_type == name


@pytest.mark.parametrize("name", ["gemma3_text", "phi3"])
def test_q8_0_files_of_the_new_architectures_match_their_dequantized_weights(hf_dirs, gguf_files, name):
    """Q8_0 blocks of Gemma 3 (norms offset, Q/K norms) and Phi-3 (the fused matrices
    quantized whole, then split): the model runs the file's dequantized weights, as HF
    holding them does."""
    path, stored = gguf_files[name, "Q8_0"]
    types = {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(str(path)).tensors}
    assert types == {"F32", "Q8_0"}
    loaded, diff = max_logit_diff_to_hf(path, hf_holding(hf_dirs[name], stored), 11)
    print(f"{name} Q8_0: max |logit diff| = {diff:.3e} over {sum(PROMPT_LENGTHS)} positions")
    assert diff <= ATOL, f"{name}: max abs logit difference {diff:.3e} > {ATOL}"
    assert loaded.config.model_type == name


def test_q8_0_file_through_the_engine_matches_its_dequantized_weights(q8_engine_result):
    engine, stats = q8_engine_result
    print(f"qwen2 Q8_0: max |logit diff| = {stats['max_diff']:.3e} over {stats['compared_rows']} rows, "
          f"{stats['steps']} steps ({stats['mixed_steps']} mixed)")
    assert stats["max_diff"] <= ATOL, f"max abs logit difference {stats['max_diff']:.3e} > {ATOL}"
    assert engine.model_config.model_type == "qwen2" and type(engine.runner.model) is LlamaForCausalLM


def test_q4_1_q4_0_and_q8_0_blocks_run_as_the_files_weights(hf_dirs, block_file, engine_parity, make_logits_engine):
    """quantization="gguf" on a file of Q4_1, Q4_0 and Q8_0 blocks: the step dequantizes each
    block (scale, and the offset of Q4_1 blocks) inside the program, in the layers
    (QuantizedKernel) and in the tied embedding, looked up and as the head (QuantizedTable).
    Through the engine, logits equal HF's holding the file's dequantized weights (Q4_0's int8
    re-fit aside, see as_gguf_quantization_holds_them), within the F32 bound; the offsets the
    step reads are really nonzero, so dropping one is seen."""
    path, stored = block_file
    types = {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(str(path)).tensors}
    assert types == {"F32", "Q4_1", "Q4_0", "Q8_0"}
    engine = make_logits_engine(
        model=str(path), quantization="gguf", warmup=False, page_size=8, max_num_batched_tokens=16,
        min_token_bucket=16, max_num_seqs=4, num_pages=64, max_model_len=128, attention_impl="reference",
        model_cache_dir=None,
    )
    params = engine.runner.params["params"]
    layer = params["layers"]
    zeros = {"embed": params["embed_qzero"], **{name: layer[block][name]["qzero"] for block, names in
                                                (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                                 ("mlp", ("gate_proj", "up_proj", "down_proj"))) for name in names}}
    nonzero = {name: float(np.mean(np.asarray(z, np.float32) != 0)) for name, z in zeros.items()}
    assert engine.model_config.quantization == "gguf" and engine.model_config.tie_word_embeddings
    assert "lm_head" not in params, "the head is the embedding table"
    for name in ("embed", "q_proj", "o_proj", "down_proj"):  # Q4_1: an offset per block
        assert nonzero[name] > 0.95, nonzero
    assert nonzero["v_proj"] == nonzero["up_proj"] == 0, nonzero  # Q8_0: symmetric
    assert int(np.asarray(params["embed"]).min()) >= 0 and int(np.asarray(params["embed"]).max()) <= 15

    stats = engine_parity(engine, hf_holding(hf_dirs["qwen2"], as_gguf_quantization_holds_them(stored)),
                          np.random.default_rng(8))
    print(f"qwen2 Q4_1/Q4_0/Q8_0 blocks: max |logit diff| = {stats['max_diff']:.3e} over "
          f"{stats['compared_rows']} rows, {stats['steps']} steps ({stats['mixed_steps']} mixed)")
    assert stats["max_diff"] <= ATOL, f"max abs logit difference {stats['max_diff']:.3e} > {ATOL}"


def test_q8_0_file_holds_quantized_weights(hf_dirs, gguf_files):
    """The Q8_0 reference is not the float model in disguise: its matrices moved, a little."""
    _, stored = gguf_files["qwen2", "Q8_0"]
    exact = _hf_model(hf_dirs["qwen2"]).state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    q8 = stored["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(q8, exact)
    np.testing.assert_allclose(q8, exact, atol=np.abs(exact).max() / 100)


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------
QWEN_TEXTS = [
    "It's 2024; I'll count 1234567890 twice: 1234567890.",
    "def f(x):\n    return x.y_z * 3.14159  # don't\n\n\n",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces, trailing  \n\tand tabs",
    "THEY'VE WE'D x.hello ...!!! ???",
]


def test_qwen_file_tokenizes_like_its_hf_tokenizer(gguf_files, qwen_tokenizer):
    loaded = load_model(gguf_files["qwen3", "F32"][0])
    for text in QWEN_TEXTS:
        assert loaded.tokenizer.encode(text, add_special_tokens=False) == qwen_tokenizer.encode(
            text, add_special_tokens=False), text
        assert loaded.tokenizer.decode(loaded.tokenizer.encode(text, add_special_tokens=False)) == text
    assert loaded.config.eos_token_ids == (qwen_tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert loaded.tokenizer.encode("hi") == loaded.tokenizer.encode("hi", add_special_tokens=False)  # no BOS


def test_qwen2_pre_tokenizer_splits_like_qwens_own(qwen_tokenizer):
    """How text is cut before BPE, compared directly (this small vocabulary has no multi-digit
    tokens, so encodings alone would not tell Qwen's single digits from Llama 3's triples)."""
    meta = qwen_style_tokenizer_metadata(qwen_tokenizer)

    def pieces(backend, text):
        normalized = backend.normalizer.normalize_str(text) if backend.normalizer else text
        return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(normalized)]

    def splitter(pre):
        return build_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                                "tokenizer.ggml.tokens": meta["tokens"], "tokenizer.ggml.token_type": meta["types"],
                                "tokenizer.ggml.merges": meta["merges"]}).backend_tokenizer

    reference = qwen_tokenizer.backend_tokenizer
    texts = [text for text in QWEN_TEXTS if "<|" not in text]  # special tokens are matched before splitting
    for pre in ("qwen2", "deepseek-r1-qwen"):  # llama.cpp's two names for it
        assert [pieces(splitter(pre), t) for t in texts] == [pieces(reference, t) for t in texts], pre
    for other in ("gpt2", "llama-bpe"):
        assert [pieces(splitter(other), t) for t in texts] != [pieces(reference, t) for t in texts], other
    assert pieces(splitter("qwen2"), "x 2024") == ["x", "Ġ", "2", "0", "2", "4"]


# ---------------------------------------------------------------------------------------------
# Metadata -> config, and what is refused
# ---------------------------------------------------------------------------------------------
def _meta(arch: str, **extra) -> dict:
    meta = {"general.architecture": arch, "tokenizer.ggml.eos_token_id": 2}
    sizes = {"embedding_length": 64, "feed_forward_length": 128, "block_count": 2, "attention.head_count": 4,
             "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6,
             "context_length": 1024}
    meta.update({f"{arch}.{k}": v for k, v in {**sizes, **extra}.items()})
    return meta


def test_mistral_window_is_read_from_the_file_only():
    """llama.cpp writes Mistral as "llama" without its window; such a file runs with full
    attention (as in llama.cpp), one that names a window gets it, 0 means none."""
    plain = gguf_config(_meta("llama"))
    assert (plain.model_type, plain.sliding_window) == ("llama", None)
    c = gguf_config(_meta("llama", **{"attention.sliding_window": 4096}))
    assert (c.model_type, c.sliding_window) == ("mistral", 4096)
    assert gguf_config(_meta("llama", **{"attention.sliding_window": 0})).sliding_window is None
    everywhere = {"attention.sliding_window": 64, "attention.sliding_window_pattern": [True, True]}
    assert gguf_config(_meta("llama", **everywhere)).sliding_window == 64
    mixed = gguf_config(_meta("llama", **{**everywhere, "attention.sliding_window_pattern": [True, False]}))
    assert mixed.layer_windows() == (64, None)


def test_rope_scalings_and_partial_rotary_are_read_as_hf_spells_them():
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 256,
            "rope.scaling.yarn_beta_fast": 16.0}
    assert dict(gguf_config(_meta("qwen2", **yarn)).rope_scaling) == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 16.0}
    linear = gguf_config(_meta("qwen2", **{"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}))
    assert dict(linear.rope_scaling) == {"rope_type": "linear", "factor": 2.0}
    assert gguf_config(_meta("qwen2", **{"rope.dimension_count": 8})).partial_rotary_factor == 0.5
    assert gguf_config(_meta("qwen2", **{"rope.dimension_count": 16})).partial_rotary_factor == 1.0


def test_qwen_metadata_gives_the_qwen_switches():
    c = gguf_config(_meta("qwen2"))
    assert (c.model_type, c.qkv_bias, c.o_bias, c.qk_norm, c.head_dim) == ("qwen2", True, False, False, 16)
    assert (c.rope_theta, c.max_position_embeddings, c.rms_norm_eps) == (1e6, 1024, pytest.approx(1e-6))
    c = gguf_config(_meta("qwen3", **{"attention.key_length": 128, "attention.value_length": 128}))
    assert (c.model_type, c.qk_norm, c.qkv_bias, c.head_dim, c.eos_token_ids) == ("qwen3", True, False, 128, (2,))
    assert gguf_arch.rope_rows_permuted(_meta("llama")) and not gguf_arch.rope_rows_permuted(_meta("qwen2"))
    assert not gguf_arch.rope_rows_permuted(_meta("qwen3"))


@pytest.mark.parametrize("extra,match", [
    ({"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0}, "'longrope' needs short_factor"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_log_multiplier": 0.1},
     "yarn_log_multiplier"),
    ({"rope.dimension_count": 24}, "does not fit head_dim 16"),
    ({"attention.key_length": 16, "attention.value_length": 32}, "value_length"),
    ({"attention.head_count_kv": [2, 4]}, "differs between layers"),
])
def test_metadata_the_model_cannot_honour_is_refused(extra, match):
    with pytest.raises(ValueError, match=match):
        gguf_config(_meta("qwen2", **extra))
    # ... while per-layer arrays that agree, and "none" scaling, are fine.
    agreeing = {"attention.head_count_kv": [2, 2], "rope.scaling.type": "none"}
    assert gguf_config(_meta("qwen2", **agreeing)).num_kv_heads == 2


@pytest.mark.parametrize("arch", ["gpt2", "bert", "mistral3"])
def test_unknown_architecture_is_refused_listing_the_supported_ones(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"unsupported GGUF architecture '{arch}'") as info:
        load_model(path)
    assert str(info.value).endswith(
        "supported: llama, qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3, phi3, gpt-oss"
    )
    assert SUPPORTED_GGUF_ARCHITECTURES == (
        "llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "phi3", "gpt-oss",
    )
    if arch == "gpt2":
        assert "attn_qkv" in str(info.value)  # says why, not just no
