"""Offline throughput: orca_jax against transformers' static batching and continuous batching.

Moved into the package as `orca-jax bench offline` (orca_jax/bench/offline.py and peers.py), so
it runs from an installed wheel; this script keeps the old command working with the same
options:

    python benchmarks/throughput.py --max-model-len 512 --json docs/throughput_cpu.json
    orca-jax bench offline --max-model-len 512 --json docs/throughput_cpu.json     # the same run
"""

from __future__ import annotations

import argparse
import sys

from orca_jax.bench.cli import add_offline_arguments, cmd_offline


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_offline_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return cmd_offline(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
