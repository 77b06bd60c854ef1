"""What the machine of an accelerator session is, as JSON: the first stage of a session plan.

jax's backend, its devices (kind, memory), the versions of what the project runs on, and whether
each optional package the machine may lack imports (the device machine has no gguf, fastapi,
uvicorn or llguidance unless wheels were carried: benchmarks/gpu_session.sh says how). A stage of
its own, in a process of its own: initialising jax's backend takes the accelerator (a TPU
admits one process), which the session runner must leave free for the stages after it.

    python benchmarks/machine_facts.py --json facts.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import sys

VERSIONS = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "tokenizers", "safetensors",
            "numpy", "torch", "jax-cuda13-plugin", "jax-cuda12-plugin", "libtpu")
# Imported only by the features that need them (module name -> what needs it).
OPTIONAL = {"llguidance": "structured outputs", "gguf": "GGUF checkpoints", "fastapi": "the HTTP server",
            "uvicorn": "the HTTP server"}


def versions() -> dict[str, str | None]:
    found = {}
    for name in VERSIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def importable() -> dict[str, bool]:
    result = {}
    for module in OPTIONAL:
        try:
            importlib.import_module(module)
            result[module] = True
        except Exception:  # ImportError, or a broken install: either way the feature cannot run
            result[module] = False
    return result


def devices() -> dict:
    import jax

    listed = []
    for device in jax.devices():
        entry = {"id": device.id, "platform": device.platform, "device_kind": device.device_kind}
        try:
            stats = device.memory_stats() or {}
            entry["memory_bytes_limit"] = stats.get("bytes_limit")
        except Exception:  # not every backend reports memory
            pass
        listed.append(entry)
    return {"backend": jax.default_backend(), "device_count": jax.device_count(), "devices": listed}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    facts = {"python": platform.python_version(), "platform": platform.platform(), "versions": versions(),
             "importable": importable(), **devices()}
    text = json.dumps(facts, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
