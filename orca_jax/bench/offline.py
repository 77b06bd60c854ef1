"""`orca-jax bench offline`: every request at t=0, orca_jax against transformers' static-batch
`generate` and its continuous batching (peers.py), in one process, and, when asked for, vLLM's
CPU build in its own environment (vllm_peer.py), on the same weights and the same requests
(Orca's length distributions, scaled; random prompt token ids; EOS ignored; greedy). The
systems run one after another: orca_jax, then the peers in the order named.

A vLLM peer that is not installed is skipped with a message saying how to install it; the
skip is recorded in the result (`skipped_peers`).

Model construction and warm-up are outside the timed part and reported on their own. The CPU
roofline (roofline.py) comes from a measured matmul rate and the FLOPs of the useful tokens.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from typing import Any

from orca_jax.bench import environment, roofline, vllm_peer
from orca_jax.bench.driver import BenchmarkError, greedy_no_eos
from orca_jax.bench.peers import (DEFAULT_PEERS, HF_PEERS, PEERS, SYSTEM_NAMES, VLLM_PEERS, load_hf_model,
                                  resolve_device, run_hf_continuous, run_hf_static, system_result)
from orca_jax.bench.trace import Trace, make_trace

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OfflineSettings:
    model: str | None = None
    num_requests: int = 48
    scale: float = 0.5
    max_num_seqs: int = 16  # also the static batch size and the continuous peer's requests per batch
    max_num_batched_tokens: int = 256  # also the continuous peer's max_batch_tokens
    dtype: str = "float32"  # orca_jax's; the transformers peers always run float32
    max_model_len: int | None = None
    page_size: int = 16
    peers: tuple[str, ...] = DEFAULT_PEERS  # PEERS names them all; the vLLM ones run in vLLM's own Python
    seed: int = 0
    torch_threads: int | None = None  # None: torch's default
    torch_device: str = "auto"  # cuda when available
    matmul_size: int = 2048
    matmul_repeats: int = 5
    async_scheduling: bool = True  # orca_jax's overlapped steps (False: one step at a time)
    # orca_jax replicas (each on its own device; on CPU force devices with
    # XLA_FLAGS=--xla_force_host_platform_device_count=N before the start)
    data_parallel_size: int = 1
    vllm_python: str | None = None  # None: $ORCA_JAX_VLLM_PYTHON, then found (vllm_peer.find_vllm_python)
    vllm_omp_bind: str | None = None  # the vllm_bind peer's cores; None: all this process may use
    vllm_timeout_s: float = 1800.0  # per vLLM peer: engine start, warm-up and the run

    def __post_init__(self):
        if unknown := [p for p in self.peers if p not in PEERS]:
            raise ValueError(f"unknown peer(s) {unknown}; choose from {list(PEERS)}")
        if self.vllm_omp_bind is not None:
            vllm_peer.valid_omp_bind(self.vllm_omp_bind)

    @property
    def hf_peers(self) -> list[str]:
        return [p for p in self.peers if p in HF_PEERS]

    @property
    def vllm_peers(self) -> list[str]:
        return [p for p in self.peers if p in VLLM_PEERS]

    def vllm_settings(self, kv_cache_bytes: int) -> vllm_peer.VllmSettings:
        return vllm_peer.VllmSettings(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_model_len=self.max_model_len, seed=self.seed, kv_cache_bytes=kv_cache_bytes,
                                      omp_bind=self.vllm_omp_bind, timeout_s=self.vllm_timeout_s)


def start_orca(s: OfflineSettings) -> dict[str, Any]:
    """Build the engine (weights load + XLA warm-up over every token bucket), outside timing."""
    from orca_jax.entrypoints.llm import LLM

    engine_args = dict(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                       dtype=s.dtype, page_size=s.page_size, async_scheduling=s.async_scheduling,
                       data_parallel_size=s.data_parallel_size)
    if s.max_model_len is not None:
        engine_args["max_model_len"] = s.max_model_len
    rss_before = environment.current_rss_bytes()  # imports only, nothing loaded yet
    start = time.perf_counter()
    llm = LLM(model=s.model, **engine_args)
    return {"llm": llm, "engine_args": engine_args, "startup_s": time.perf_counter() - start,
            "rss_before_engine_bytes": rss_before}


def run_orca(llm, trace: Trace) -> dict[str, Any]:
    import jax

    from orca_jax.worker.compile_guard import compile_count
    from orca_jax.core.kv_cache import kv_bytes_per_page

    engine, replicas = llm.engine, llm.replicas
    start = time.perf_counter()  # untimed warm-up through the whole host path, of every replica
    llm.generate([p[:8] for p in trace.prompts[:len(replicas)]], greedy_no_eos(2), use_tqdm=False)
    warmup_generate_s = time.perf_counter() - start

    def total_steps() -> int:
        return sum(e.num_steps for e in replicas)

    compiles, steps = compile_count(), total_steps()
    start = time.perf_counter()
    outputs = llm.generate(trace.prompts, [greedy_no_eos(o) for o in trace.output_lens], use_tqdm=False)
    wall_s = time.perf_counter() - start
    compiles, steps = compile_count() - compiles, total_steps() - steps

    for i, (out, want) in enumerate(zip(outputs, trace.output_lens)):
        if out.error is not None:
            raise BenchmarkError(f"orca_jax request {i} failed: {out.error}")
        if len(out.token_ids) != want or out.finish_reason != "length":
            raise BenchmarkError(f"orca_jax request {i} produced {len(out.token_ids)} tokens "
                                 f"({out.finish_reason!r}), expected {want}")
    if leaked := sum(e.allocator.num_used for e in replicas):
        raise BenchmarkError(f"orca_jax left {leaked} KV pages in use after the run")
    if compiles:
        logger.warning("orca_jax compiled %d XLA program(s) during the timed run", compiles)
    # Every replica's: each holds its own weights and pool.
    weight_bytes = len(replicas) * sum(int(leaf.nbytes) for leaf in jax.tree.leaves(engine.runner.params))
    kv_bytes = len(replicas) * engine.runner.num_pages * kv_bytes_per_page(
        engine.model_config, engine.config.page_size, engine.runner.kv_dtype)
    return system_result(
        SYSTEM_NAMES["orca"], trace, wall_s, trace.useful_processed_tokens, 0,
        warmup_generate_s=warmup_generate_s, engine_steps=steps, xla_compiles_during_run=compiles,
        weight_bytes=weight_bytes, kv_cache_bytes=kv_bytes, num_kv_pages=engine.runner.num_pages,
        page_size=engine.config.page_size, max_model_len=engine.config.max_model_len,
        token_buckets=list(engine.config.token_buckets), dtype=engine.config.dtype,
        attention_impl=engine.attention_impl, data_parallel_size=len(replicas),
    )


def run_peers(s: OfflineSettings, trace: Trace) -> tuple[list[dict], dict]:
    """Each transformers peer asked for on the trace; (results, {load seconds, weight bytes, device})."""
    device = resolve_device(s.torch_device)
    hf, load_s, weight_bytes = load_hf_model(s.model, device)
    results = []
    if "static" in s.peers:
        results.append(run_hf_static(hf, trace, s.max_num_seqs))
    if "continuous" in s.peers:
        results.append(run_hf_continuous(hf, trace, max_num_seqs=s.max_num_seqs, page_size=s.page_size,
                                         max_num_batched_tokens=s.max_num_batched_tokens, seed=s.seed))
    del hf
    gc.collect()
    return results, {"hf_load_s": load_s, "hf_weight_bytes": weight_bytes, "torch_device": device}


def add_ratios(systems: list[dict[str, Any]], roof: dict[str, float]) -> None:
    peers = {s["system"]: s["useful_output_tokens_per_s"] for s in systems if s["system"] != SYSTEM_NAMES["orca"]}
    for s in systems:
        s["ratio_vs"] = {peer: s["useful_output_tokens_per_s"] / tps for peer, tps in peers.items()}
        s["roofline_share"] = s["useful_output_tokens_per_s"] / roof["useful_output_tokens_per_s"]


def find_vllm(s: OfflineSettings) -> tuple[vllm_peer.VllmPython | None, list[dict[str, str]]]:
    """(vLLM's interpreter, skipped peers): found before the long orca_jax run, so that a wrong
    --vllm-python fails at once and a missing vLLM is said at once."""
    if not s.vllm_peers:
        return None, []
    try:
        return vllm_peer.find_vllm_python(s.vllm_python), []
    except vllm_peer.VllmNotFound as exc:
        logger.warning("skipping the peer(s) %s: %s", ", ".join(s.vllm_peers), exc)
        return None, vllm_peer.skip_records(s.vllm_peers, str(exc))


def run_offline(s: OfflineSettings, command: str = "", progress=print) -> dict[str, Any]:
    """Run every system on one trace and return all numbers (the JSON record); `progress`
    gets a line as each system finishes."""
    started = environment.now_utc()
    vllm_python, skipped_peers = find_vllm(s)
    torch_threads = None
    # torch: for the transformers peers, and to convert a GGUF file into the directory vLLM reads.
    if s.hf_peers or (vllm_python is not None and vllm_peer.needs_conversion(s.model)):
        from orca_jax.bench.peers import import_torch

        torch = import_torch()  # fail before the long orca_jax run, not after it
        if s.torch_threads:
            torch.set_num_threads(s.torch_threads)
        torch_threads = torch.get_num_threads()

    orca_start = start_orca(s)  # orca_jax first, so the peak RSS read after it is its own
    llm = orca_start["llm"]
    model_config = llm.engine.model_config
    special = tuple(getattr(llm.get_tokenizer(), "all_special_ids", ()) or ())
    trace = make_trace(s.num_requests, s.scale, s.seed, vocab_size=model_config.vocab_size, exclude_ids=special)
    param_counts = roofline.count_params(llm.engine.runner.params)
    orca = run_orca(llm, trace)
    progress(f"orca_jax: {orca['wall_s']:.1f} s")
    memory = {"orca_weight_bytes": orca["weight_bytes"], "orca_kv_cache_bytes": orca["kv_cache_bytes"],
              "rss_before_orca_engine_bytes": orca_start["rss_before_engine_bytes"],
              "peak_rss_after_orca_bytes": environment.peak_rss_bytes(),
              "rss_after_orca_bytes": environment.current_rss_bytes()}
    model_source = llm.engine.config.model
    startup = {"orca_engine_s": orca_start["startup_s"]}
    del llm, orca_start
    gc.collect()

    systems = [orca]
    if s.hf_peers:
        peer_results, peer_info = run_peers(s, trace)
        systems += peer_results
        startup["hf_load_s"] = peer_info.pop("hf_load_s")
        memory["hf_weight_bytes"] = peer_info.pop("hf_weight_bytes")
        startup.update(peer_info)
    if vllm_python is not None:
        # The same KV memory as orca_jax's pool.
        peer_results, peer_info = vllm_peer.run_vllm_peers(vllm_python, s.model, trace, s.vllm_peers,
                                                           s.vllm_settings(orca["kv_cache_bytes"]))
        systems += peer_results
        startup.update(peer_info)
    memory["peak_rss_bytes"] = environment.peak_rss_bytes()

    matmul = roofline.measure_matmul_rate(s.matmul_size, s.matmul_repeats,
                                          extra_jax_dtypes=("bfloat16",) if s.dtype == "bfloat16" else ())
    flops = roofline.workload_flops(trace, model_config, param_counts)
    roof = roofline.roofline(trace, flops, matmul["roofline_flop_per_s"], param_counts)
    add_ratios(systems, roof)
    return {
        **environment.record_header("offline", command, started), "settings": dataclasses.asdict(s),
        "model": model_source or _default_model_name(),
        "torch_num_threads": torch_threads,
        "trace": {**trace.describe(), "input_lens": trace.input_lens, "output_lens": trace.output_lens},
        "model_config": dataclasses.asdict(model_config), "params": param_counts, "matmul": matmul,
        "flops": flops, "roofline": roof, "memory": memory, "startup": startup, "systems": systems,
        "skipped_peers": skipped_peers,
    }


def _default_model_name() -> str:
    from orca_jax.loading.loader import default_model_path

    return str(default_model_path())


# ---- report ---------------------------------------------------------------------------------------
def format_table(result: dict[str, Any]) -> str:
    systems = result["systems"]
    peers = [s["system"] for s in systems if s["system"] != SYSTEM_NAMES["orca"]]
    header = ["system", "requests", "useful out tok", "processed tok", "wasted tok", "wall s", "useful out tok/s",
              *[f"x {p}" for p in peers], "% roofline"]
    rows = [header]
    for s in systems:
        rows.append([
            s["system"], str(s["requests"]), str(s["useful_output_tokens"]), str(s["processed_tokens"]),
            str(s["wasted_tokens"]), f"{s['wall_s']:.2f}", f"{s['useful_output_tokens_per_s']:.1f}",
            *[f"{s['ratio_vs'][p]:.2f}" for p in peers], f"{100 * s['roofline_share']:.1f}",
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _replicas(orca: dict) -> str:
    dp = orca.get("data_parallel_size", 1)
    return f"{dp} replicas x " if dp > 1 else ""


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.3f} GiB"


def format_report(result: dict[str, Any]) -> str:
    t, roof, mem, mm = result["trace"], result["roofline"], result["memory"], result["matmul"]
    orca, startup = result["systems"][0], result["startup"]
    lines = [
        f"model: {result['model']}",
        f"trace: {t['num_requests']} requests at t=0, input U{t['input_range']} (mean {t['mean_input_len']:.1f}), "
        f"output U{t['output_range']} (mean {t['mean_output_len']:.1f}), EOS ignored, greedy, "
        f"seed {result['settings']['seed']}",
        f"orca_jax dtype {orca['dtype']}; transformers peers float32 on {startup.get('torch_device', 'n/a')}, "
        f"torch threads {result['torch_num_threads']} (os.cpu_count() = {result['machine']['cpu_count']})",
        "",
        format_table(result),
        "",
        f"startup (outside the timed runs): orca_jax engine build (load + XLA warm-up of buckets {orca['token_buckets']}) "
        f"{startup['orca_engine_s']:.1f} s, first generate {orca['warmup_generate_s']:.2f} s"
        + "".join(f"; {s['system']} warm-up {s['warmup_generate_s']:.2f} s" for s in result["systems"][1:])
        + (f"; transformers load {startup['hf_load_s']:.1f} s" if "hf_load_s" in startup else "")
        + "".join(f"; {s['system']} engine start {s['load_s']:.1f} s" for s in result["systems"] if "vllm_version" in s)
        + (f"; GGUF -> HF directory for vLLM {startup['vllm_convert_s']:.1f} s" if startup.get("vllm_convert_s") else ""),
        f"orca_jax: {orca['engine_steps']} engine steps, {orca['xla_compiles_during_run']} XLA compiles during the timed run",
        f"roofline: matmul {mm['size']}x{mm['size']} "
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in mm["flop_per_s"].items())
        + f" GFLOP/s (using {mm['best']}); workload {result['flops']['total'] / 1e9:.1f} GFLOP -> ideal "
        f"{roof['ideal_seconds']:.2f} s, {roof['useful_output_tokens_per_s']:.1f} useful output tok/s",
        f"memory: orca_jax weights {_gib(mem['orca_weight_bytes'])} + KV cache {_gib(mem['orca_kv_cache_bytes'])} "
        f"({_replicas(orca)}{orca['num_kv_pages']} pages x {orca['page_size']} tokens); peak RSS after orca_jax "
        f"{_gib(mem['peak_rss_after_orca_bytes'])}, process peak {_gib(mem['peak_rss_bytes'])}",
    ]
    lines += _vllm_lines(result)
    return "\n".join(lines)


def _vllm_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"{s['system']}: vLLM {s['vllm_version']} float32 ({s['vllm_python']}), OpenMP threads bind "
             f"{s['omp_threads_bind']}, block size {s['engine_settings']['block_size']}"
             for s in result["systems"] if "vllm_version" in s]
    skipped = result.get("skipped_peers", [])
    if skipped:
        lines.append(f"skipped {', '.join(k['system'] for k in skipped)}: {skipped[0]['reason']}")
    return lines
