"""The platform a program being traced is for.

Usually this host's backend. While a step is lowered for another platform on this host (a TPU
or CUDA program built on a CPU: orca_jax/worker/cross_lowering.py), it is the platform of the
abstract device of the abstract mesh the lowering runs under: the same place jax's own Pallas
TPU and GPU lowerings read the device they compile for (`tpu_info`, the Triton lowering's
compute capability). Choices made at trace time by backend (the grouped expert matmuls, the
GPU kernel's interpreter off a GPU) read it here, so that a cross-lowered program is the one
the target would build.
"""

from __future__ import annotations

import jax

# jax's platform names for abstract devices -> its backend names.
_BACKEND_OF_PLATFORM = {"cuda": "gpu", "rocm": "gpu"}


def target_backend() -> str:
    """"cpu", "gpu" or "tpu": the backend the traced program will run on."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    platform = getattr(device, "platform", None)
    if platform:
        return _BACKEND_OF_PLATFORM.get(platform, platform)
    return jax.default_backend()
