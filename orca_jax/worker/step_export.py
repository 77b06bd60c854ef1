"""Step programs kept between runs as serialized `jax.export`s, so that a warm start does not
trace the model again.

JAX's persistent compilation cache (compilation_cache.py) spares XLA's compile, not what comes
before it: tracing the flax model (its `nn.scan` traces the layer body twice, the sampler is a
large part of each program) and lowering it to StableHLO, 1.1-1.5 s per token bucket on 2
cores, and `generate` builds two buckets before its first token. So the runner exports each
bucket's step once (`jax.export.export`: the StableHLO module and its calling convention), keeps
the bytes here, and a later start deserializes them (~0.01 s) and lowers `Exported.call`
(~0.3 s) instead of tracing.

Every start compiles the same module, the exported one called through
`jax.jit(exported.call, donate_argnums=...)`, whether it exported it now or read it back: so the
first start's compile is the next start's persistent-cache hit, and both run the very program
(tests/worker/test_step_export.py: the same tokens and logits as the plain traced step). Donation passes
through: the KV cache and the batch state are still updated in place.

A file is named by a digest (`program_key`) of everything that determines the program: the
orca_jax sources, the versions of jax, jaxlib, flax, numpy and ml_dtypes, the jax flags that
change tracing, the backend, the runner's static parts (model and engine config, attention
implementation, dtype) and the pytree, shape, dtype and sharding of every argument. A change in
any of them is a new name (a cold start for that bucket), never a stale program; a file that
does not deserialize or does not fit its arguments is logged, ignored and rewritten.

    <compilation cache dir>/orca_jax_steps/step-<digest>.jaxexport

The files live in the compilation cache's directory (`compilation_cache.active_cache_dir`) and
are off when it is: JAX only reads its own `*-cache` files there. Written whole and renamed into
place, so a concurrent start reads the old file or the new one, never half of one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import jax

from orca_jax.models.prompt_logprobs import PromptLogprobs
from orca_jax.worker.batch_state import DeviceState, StepInputs
from orca_jax.worker.sampling import SampleOutput

logger = logging.getLogger(__name__)

DIRECTORY = "orca_jax_steps"
SUFFIX = ".jaxexport"
# What the key records of the libraries: each one's version changes what a trace produces.
_LIBRARIES = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes")
# jax flags that change what a trace produces (dtypes, precision, random bits).
_TRACING_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_dtype_promotion",
                  "jax_default_prng_impl", "jax_threefry_partitionable", "jax_numpy_rank_promotion",
                  "jax_enable_custom_prng")
# The pytree classes in a step's arguments and results: jax.export serializes the trees by name.
_PYTREE_CLASSES = (DeviceState, StepInputs, SampleOutput, PromptLogprobs)


def _register_pytrees() -> bool:
    """Tell jax.export how to write the step's dataclass nodes (no metadata: their fields are
    all data). False if this jax cannot, which turns exporting off."""
    try:
        for cls in _PYTREE_CLASSES:
            jax.export.register_pytree_node_serialization(
                cls, serialized_name=f"orca_jax.{cls.__qualname__}",
                serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
                deserialize_auxdata=lambda data: tuple(json.loads(data)))
    except Exception as exc:  # noqa: BLE001 - an API change costs the speed-up, never a start
        logger.warning("step programs will not be exported (jax.export cannot register the step's pytrees: %s)", exc)
        return False
    return True


_REGISTERED = _register_pytrees()


class StepExports:
    """The exported step programs of one runner. `directory`: where the files are;
    `static_key`: the runner's parts of the key; `donate_argnums`: the step's donated
    positional arguments."""

    def __init__(self, directory: str | Path, static_key: dict[str, Any], donate_argnums: tuple[int, ...]):
        self.directory = Path(directory)
        self.static_key = static_key
        self.donate_argnums = donate_argnums
        self.loaded: list[str] = []  # file names read back in this process (tests, logs)
        self.refused: str | None = None  # why jax.export could not export this runner's step

    def lower(self, jitted, args: tuple) -> jax.stages.Lowered:
        """The step lowered for `args` through its exported program: read back when a file for
        these arguments exists, else exported from `jitted` now (and saved)."""
        if self.refused is not None:
            return jitted.lower(*args)
        path = self.directory / f"step-{program_key(self.static_key, args)}{SUFFIX}"
        exported = self._read(path, args)
        if exported is None:
            try:
                exported = jax.export.export(jitted)(*args)
            except Exception as exc:  # noqa: BLE001 - e.g. a kernel's custom call jax.export does not vouch for
                # Refused for good: every start then lowers the traced step, so cold and warm agree.
                self.refused = f"{type(exc).__name__}: {exc}"
                logger.warning("step programs are traced at every start: jax.export refused the step (%s)",
                               self.refused.splitlines()[0])
                return jitted.lower(*args)
            self._write(path, exported)
        else:
            self.loaded.append(path.name)
        def model_step(*step_args):  # named so: its compiled programs are cached as jit_model_step-*
            return exported.call(*step_args)

        return jax.jit(model_step, donate_argnums=self.donate_argnums).lower(*args)

    def _read(self, path: Path, args: tuple):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("exported step %s unreadable (%s); tracing the step", path, exc)
            return None
        try:
            exported = jax.export.deserialize(bytearray(data))
            if exported.in_tree != jax.tree.structure((args, {})):
                raise ValueError("its argument tree is not this step's")
        except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: export again
            logger.warning("exported step %s cannot be used (%s: %s); tracing the step", path, type(exc).__name__, exc)
            return None
        return exported

    def _write(self, path: Path, exported) -> None:
        temp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            temp.write_bytes(exported.serialize())
            os.replace(temp, path)
        except Exception as exc:  # noqa: BLE001 - not saved only costs the next start a trace
            logger.warning("could not save the exported step %s (%s: %s)", path, type(exc).__name__, exc)
            temp.unlink(missing_ok=True)


def exports_for(cache_dir: str | None, static_key: dict[str, Any],
                donate_argnums: tuple[int, ...]) -> StepExports | None:
    """The runner's exports, as files under the compilation cache `cache_dir`. None (the runner
    then lowers its traced step directly) without a compilation cache, where every start compiles
    anyway and an export would only add its ~0.3 s, or when this jax cannot export the step or
    serialize it (flatbuffers missing)."""
    if cache_dir is None or not _REGISTERED:
        return None
    if importlib.util.find_spec("flatbuffers") is None:  # jax.export's serializer needs it
        logger.warning("step programs are traced at every start: install flatbuffers for jax.export to save them")
        return None
    return StepExports(Path(cache_dir) / DIRECTORY, static_key, donate_argnums)


def program_key(static_key: dict[str, Any], args: tuple) -> str:
    """A digest of everything that determines the step program for `args` (see the module's doc)."""
    leaves, tree = jax.tree.flatten(args)
    described = {
        "static": static_key,
        "tree": str(tree),
        "leaves": [_describe_leaf(leaf) for leaf in leaves],
        "environment": _environment(),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=repr).encode()).hexdigest()[:32]


def _describe_leaf(leaf) -> list:
    aval = jax.typeof(leaf)
    sharding = getattr(leaf, "sharding", None)
    return [str(aval.dtype), list(aval.shape), bool(getattr(aval, "weak_type", False)),
            bool(getattr(leaf, "_committed", False)), repr(sharding)]


@functools.cache
def _environment() -> dict[str, Any]:
    """The per-process part of the key: sources, libraries, tracing flags, backend."""
    device = jax.local_devices()[0]
    return {
        "sources": sources_digest(),
        "libraries": {name: _version(name) for name in _LIBRARIES},
        "flags": {name: repr(getattr(jax.config, name, None)) for name in _TRACING_FLAGS},
        "backend": [jax.default_backend(), device.platform, device.device_kind, jax.local_device_count()],
    }


def sources_digest() -> str:
    """A digest of every .py file of the orca_jax package (~10 ms): any code change is a new
    program, so no one has to remember which modules a step reaches."""
    package = Path(__file__).parents[1]
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(str(source.relative_to(package)).encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
