"""What an NVIDIA GPU can do, read from jax's device object: its compute capability, and the
features the engine chooses by it.

    capability   GPUs             bfloat16   Triton tensor-core dots   fp8 matmul
    70           V100             no         no (FMA code)             no
    75           T4               no         no (FMA code)             no
    80, 86       A100, A10, 3090  yes        mma.sync                  no
    89           L4, L40          yes        mma.sync                  yes
    90           H100, H200       yes        wgmma / mma.sync          yes

Triton (the Pallas GPU lowering) emits tensor-core MMA only from sm_80: below it, its
AccelerateMatmul pass leaves every dot to FMA code ("MMA for compute capability < 80 has been
deprecated"), whatever the dtype. That is why the kernel's tiles differ there
(`ragged_paged_attention_gpu.choose_tiles`).
"""

from __future__ import annotations

# The first compute capability with bfloat16 arithmetic, and with Triton's tensor-core dots.
BFLOAT16_MIN_CAPABILITY = 80
TRITON_MMA_MIN_CAPABILITY = 80
FP8_MATMUL_MIN_CAPABILITY = 89


def compute_capability(device) -> int | None:
    """A CUDA device's compute capability as one number (75 for "7.5"); None for any other
    device, or a GPU that does not report it."""
    if getattr(device, "platform", None) != "gpu":
        return None
    major, _, minor = str(getattr(device, "compute_capability", "")).partition(".")
    minor = minor or "0"
    return int(major) * 10 + int(minor) if major.isdigit() and minor.isdigit() else None


def has_bfloat16(capability: int | None) -> bool:
    """None (not a GPU, or unknown) counts as capable: TPUs and CPUs have bfloat16."""
    return capability is None or capability >= BFLOAT16_MIN_CAPABILITY
