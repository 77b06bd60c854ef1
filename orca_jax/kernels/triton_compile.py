"""The Pallas GPU kernel compiled for NVIDIA GPUs on a machine without one, and what ptxas
says about it: registers per thread, spilled bytes, shared memory, which matrix instruction.

Why this exists: the kernel's tests run it in Pallas' interpreter on CPU, which shows whether
it computes the right thing but not whether it compiles well. A kernel whose accumulators do
not fit in registers spills them to local memory and runs several times slower; that shows
only in the GPU compiler's output, and it can be read without a GPU:

1. jax lowers a jitted step for CUDA from a CPU (`lowering_platforms=("cuda",)`). Each Pallas
   Triton kernel becomes one custom call (`__gpu$xla.gpu.triton`) whose backend config holds
   the kernel's Triton IR (TTIR) as MLIR bytecode, with its grid, warps and pipeline stages.
   On a GPU, XLA compiles that IR with the Triton it embeds.
2. The bytecode is printed as MLIR text with jaxlib's own Triton dialect: bytecode of one
   Triton version does not load into another (jaxlib 0.10's fails in triton 3.9 on an
   attribute whose type changed), while the text form parses.
3. The `triton` package's NVIDIA backend runs its stages (TTIR -> TTGIR -> LLVM IR -> PTX, the
   pipeline XLA's Triton compiler mirrors) for a chosen compute capability, and the ptxas
   shipped inside the triton wheel compiles the PTX with `-v`, whose report gives registers
   and spills.

The numbers are triton's and its ptxas', not those of the Triton inside XLA; the two track
each other closely enough to catch a kernel that spills (kept to one pinned triton version in
the test extras, so that a change of numbers is a change of the kernel).

Since jax 0.11 the Triton lowering asks for a GPU's kind to choose its compute capability;
`lower_triton_kernels` names one through an abstract device (an H100 by default), which jax
0.10 ignores (it assumes sm_90 when it finds no GPU). The kernel's TTIR does not depend on the
capability (jax uses it for float8 casts only), so one lowering serves every target.

    python -m orca_jax.kernels.triton_compile     # the serving shapes' table, ~1 minute
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxlib.mlir import ir as jax_ir
from jaxlib.triton import dialect as jax_triton_dialect

from orca_jax.kernels import gpu_info, kv_quant
from orca_jax.kernels import ragged_paged_attention_gpu as gpu
from orca_jax.kernels.metadata import AttentionMetadata

# The custom call that carries a Pallas Triton kernel (jax >= 0.11 also names it in
# `pltriton.CUSTOM_CALL_TARGET_NAME`).
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
# GPUs that serving fleets run, by compute capability: Hopper (H100/H200) and Ampere (A100).
SERVING_CAPABILITIES = (90, 80)
# What Colab's free GPU (T4) and older clusters (V100) are: float16 and FMA-only Triton dots.
PRE_AMPERE_CAPABILITIES = (75, 70)


@dataclass(frozen=True)
class TritonKernel:
    """One Pallas Triton kernel of a lowered step, as jax hands it to XLA."""
    name: str
    ttir: str  # Triton IR as MLIR text
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


@dataclass(frozen=True)
class CompileReport:
    """What the GPU compiler made of one kernel for one target; sizes are bytes per thread
    except `shared_memory` (bytes per program)."""
    arch: str  # ptxas' target name, e.g. "sm_90a"
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    shared_memory: int
    matmul: str  # "wgmma" (Hopper warpgroup MMA), "mma.sync" (tensor cores, Ampere style) or "fma"

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


# --------------------------------------------------------------------------------------------
# 1-2. From a jitted function to the Triton IR of its kernels.
# --------------------------------------------------------------------------------------------

def abstract_gpu_mesh(device_kind: str = "NVIDIA H100") -> jax.sharding.AbstractMesh:
    """A one-device mesh of an abstract GPU of `device_kind` (a name as jax's GPU table spells
    it), so that jax >= 0.11 lowers Pallas Triton kernels on a machine without a GPU."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    return jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=device)


def _walk(op):
    op = op.operation if hasattr(op, "operation") else op
    yield op
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield from _walk(child)


def _bytecode_to_text(bytecode: bytes) -> str:
    with jax_ir.Context() as context:
        jax_triton_dialect.register_dialect(context)
        return str(jax_ir.Module.parse(bytecode))


def triton_kernels_of(stablehlo: jax_ir.Module) -> list[TritonKernel]:
    """Every Pallas Triton kernel in a lowered StableHLO module, in program order."""
    kernels = []
    for op in _walk(stablehlo.operation):
        if op.name != "stablehlo.custom_call":
            continue
        if jax_ir.StringAttr(op.attributes["call_target_name"]).value != TRITON_CUSTOM_CALL:
            continue
        # api_version 4 keeps the backend config as a dictionary attribute under this name.
        config = jax_ir.DictAttr(op.attributes["mhlo.backend_config"])
        number = lambda key: jax_ir.IntegerAttr(config[key]).value  # noqa: E731
        kernels.append(TritonKernel(
            name=jax_ir.StringAttr(config["name"]).value,
            ttir=_bytecode_to_text(jax_ir.StringAttr(config["ir"]).value_bytes),
            num_warps=number("num_warps"), num_stages=number("num_stages"),
            grid=(number("grid_x"), number("grid_y"), number("grid_z"))))
    return kernels


def lower_triton_kernels(fn, *args, device_kind: str = "NVIDIA H100") -> list[TritonKernel]:
    """Lower `jax.jit(fn)(*args)` (args may be ShapeDtypeStructs) for CUDA on this machine,
    whatever its backend, and return its Pallas Triton kernels."""
    with jax.sharding.use_abstract_mesh(abstract_gpu_mesh(device_kind)):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return triton_kernels_of(lowered.compiler_ir("stablehlo"))


# --------------------------------------------------------------------------------------------
# 3. From Triton IR to PTX (triton's NVIDIA backend) and to machine code (its ptxas).
# --------------------------------------------------------------------------------------------

_PTXAS_PROPERTIES = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads")
_PTXAS_REGISTERS = re.compile(r"Used (?P<registers>\d+) registers")


def parse_ptxas_report(log: str) -> dict[str, int]:
    """Registers and spill sizes from `ptxas -v` output of a single kernel."""
    properties, registers = _PTXAS_PROPERTIES.search(log), _PTXAS_REGISTERS.search(log)
    if properties is None or registers is None:
        raise ValueError(f"no register report in ptxas output:\n{log}")
    return dict(registers=int(registers["registers"]), stack_frame=int(properties["stack"]),
                spill_stores=int(properties["stores"]), spill_loads=int(properties["loads"]))


def matmul_instruction(ptx: str) -> str:
    """The matrix instruction the kernel's products compiled to."""
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if "mma.sync" in ptx:
        return "mma.sync"
    return "fma"


def _triton_backend(capability: int):
    # Imported here: triton is a test and tooling dependency, never one of the engine.
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    return CUDABackend(GPUTarget("cuda", capability, 32))


def ttir_to_ptx(kernel: TritonKernel, capability: int) -> tuple[str, dict]:
    """PTX for compute capability `capability` (90: sm_90a, 80: sm_80), and the stages'
    metadata (`shared`: shared memory bytes), through triton's own TTIR -> PTX stages."""
    from triton._C.libtriton import ir as triton_ir
    from triton.backends.compiler import Language

    backend = _triton_backend(capability)
    context = triton_ir.context()
    triton_ir.load_dialects(context)
    backend.load_dialects(context)
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, f"{kernel.name}.ttir")  # triton parses files only
        with open(path, "w") as f:
            f.write(kernel.ttir)
        module = triton_ir.parse_mlir_module(path, context)
    module.context = context
    # Fused multiply-add on, as XLA's Triton pipeline has it (and triton's default so far).
    options = backend.parse_options(dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages,
                                         num_ctas=1, enable_fp_fusion=True))
    stages = {}
    backend.add_stages(stages, options, Language.TRITON)
    metadata = {}
    # From the TTIR stage on: it runs the clean-up passes (inliner, combine, CSE, loop unroll)
    # that jax's lowering leaves to the compiler.
    for stage in ("ttir", "ttgir", "llir", "ptx"):
        module = stages[stage](module, metadata)
    return module, metadata


def run_ptxas(ptx: str, capability: int) -> tuple[str, str]:
    """Assemble PTX with the ptxas inside the triton wheel, with the flags triton's own
    cubin stage passes (`-v` for the report, its register allocator setting); returns
    (ptxas' target name, its report)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    arch = sm_arch_from_capability(capability)
    with tempfile.TemporaryDirectory() as scratch:
        source, binary = os.path.join(scratch, "kernel.ptx"), os.path.join(scratch, "kernel.cubin")
        with open(source, "w") as f:
            f.write(ptx)
        command = [get_ptxas(capability).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                   f"--gpu-name={arch}", source, "-o", binary]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed for {arch} ({done.returncode}):\n{done.stderr}")
    return arch, done.stderr


def compile_for_nvidia(kernel: TritonKernel, capability: int) -> CompileReport:
    """Compile one kernel down to machine code for `capability` and report on it."""
    ptx, metadata = ttir_to_ptx(kernel, capability)
    arch, log = run_ptxas(ptx, capability)
    return CompileReport(arch=arch, shared_memory=int(metadata.get("shared") or 0),
                         matmul=matmul_instruction(ptx), **parse_ptxas_report(log))


# --------------------------------------------------------------------------------------------
# The attention kernel at the shapes it serves.
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionShape:
    """A model's attention heads and an engine's buckets, as the serving step sees them."""
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_num_seqs: int  # the sequence bucket S of a full decode step
    max_num_batched_tokens: int  # the token bucket T of a full prefill step
    max_model_len: int
    num_pages: int = 4096


# SmolLM2-135M's heads on configs/llama-3.2-1b-gpu.toml's engine, and Llama-3.1-8B's on
# configs/llama-3.1-8b-h100.toml's.
SERVING_SHAPES = (
    AttentionShape("smollm2-135m", num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=16,
                   max_num_seqs=128, max_num_batched_tokens=2048, max_model_len=8192),
    AttentionShape("llama-8b", num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                   max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=16384),
)


def serving_steps(shape: AttentionShape) -> dict[str, tuple[int, int]]:
    """The step kinds whose kernels differ, as (T tokens, S sequence slots): a small decode
    batch (rows of 16, KV split: partial outputs in float32 with log-sum-exps), a full decode
    batch (rows of 16, no split) and a full prefill step (rows of 64)."""
    return {
        "decode-8": (8, 8),
        f"decode-{shape.max_num_seqs}": (shape.max_num_seqs, shape.max_num_seqs),
        f"prefill-{shape.max_num_batched_tokens}": (shape.max_num_batched_tokens, shape.max_num_seqs),
    }


def attention_kernel(shape: AttentionShape, num_tokens: int, num_seq_slots: int, dtype, kv_dtype=None,
                     **kernel_options) -> TritonKernel:
    """The Triton kernel of one attention call of a serving step, with the kernel's own
    choices of rows per program and KV split unless `kernel_options` overrides them. The
    cache is in `kv_dtype` (default: `dtype`; int8 or float8_e4m3fn: the 8-bit cache of
    kv_quant, rows of head_dim + 2)."""
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    max_pages = shape.max_model_len // shape.page_size
    metadata = AttentionMetadata(
        positions=i32((num_tokens,)), slot_mapping=i32((num_tokens,)),
        page_table=i32((num_seq_slots, max_pages)), kv_lens=i32((num_seq_slots,)),
        cu_q_lens=i32((num_seq_slots + 1,)), num_seqs=i32((1,)))
    q = jax.ShapeDtypeStruct((num_tokens, shape.num_q_heads, shape.head_dim), dtype)
    kv_dtype = jnp.dtype(kv_dtype or dtype)
    kv_pages = jax.ShapeDtypeStruct(
        (shape.num_pages, shape.page_size, 2 * shape.num_kv_heads, kv_quant.cache_head_dim(shape.head_dim, kv_dtype)),
        kv_dtype)
    fn = functools.partial(gpu.ragged_paged_attention, sm_scale=shape.head_dim ** -0.5, **kernel_options)
    [kernel] = lower_triton_kernels(fn, q, kv_pages, metadata)
    return kernel


def serving_report(shapes=SERVING_SHAPES, dtypes=("bfloat16", "float16", "float32"),
                   capabilities=SERVING_CAPABILITIES + PRE_AMPERE_CAPABILITIES) -> list[dict]:
    """One row per (shape, step, dtype, target): the kernel's launch and what ptxas reports.
    Pre-Ampere targets get float16 only (no bfloat16 there) and the tiles the kernel picks for
    them (`ragged_paged_attention_gpu.choose_tiles`)."""
    rows = []
    for shape in shapes:
        for step, (T, S) in serving_steps(shape).items():
            for dtype in dtypes:
                for capability in capabilities:
                    if capability < gpu_info.TRITON_MMA_MIN_CAPABILITY and dtype != "float16":
                        continue
                    kv_block_tokens, num_warps = gpu.choose_tiles(capability, shape.head_dim)
                    kernel = _cached_kernel(shape, T, S, dtype, kv_block_tokens, num_warps)
                    report = compile_for_nvidia(kernel, capability)
                    rows.append(dict(shape=shape.name, step=step, dtype=dtype, grid=kernel.grid,
                                     num_warps=kernel.num_warps, **vars(report)))
    return rows


@functools.lru_cache(maxsize=None)
def _cached_kernel(shape, T, S, dtype, kv_block_tokens, num_warps) -> TritonKernel:
    return attention_kernel(shape, T, S, jnp.dtype(dtype), kv_block_tokens=kv_block_tokens, num_warps=num_warps)


def main() -> None:
    columns = ["shape", "step", "dtype", "arch", "grid", "num_warps", "registers", "spill_stores",
               "spill_loads", "shared_memory", "matmul"]
    print(" | ".join(columns))
    for row in serving_report():
        print(" | ".join(str(row[c]) for c in columns), flush=True)


if __name__ == "__main__":
    main()
