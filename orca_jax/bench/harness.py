"""The run around every benchmark's measurement: register its subcommand, build its settings
from the options, run it, print its report and write its JSON record.

The harness is three modules: arguments.py parses the options, environment.py records where
and how a run happened (`record_header`), and this one runs and writes. `orca-jax bench ...`
goes through `add_subcommand` and `run_benchmark`; the scripts in benchmarks/ use
`ReportFile` to keep what they measured after every stage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orca_jax.bench.arguments import options_by_dest

# Results go here unless --json/--plot say otherwise: never into docs/, whose files are the
# committed, quoted results (docs/benchmarks.md names the commands that wrote them there).
RESULTS_DIR = "bench-results"


def write_json(record: dict, path: str | None, *, quiet: bool = False) -> None:
    """Write `record` to `path` ('' or None: nowhere), its folder made if missing; values JSON
    lacks (paths, numpy scalars) as their text."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1, default=str) + "\n")
    if not quiet:
        print(f"wrote {path}")


class ReportFile:
    """A record written again after every stage, so that a run stopped by a time limit (the GPU
    session's, a shared machine's) keeps what it measured so far."""

    def __init__(self, path: str | None, record: dict):
        self.path, self.record = path, record

    def save(self) -> None:
        write_json(self.record, self.path, quiet=True)

    def add_row(self, row: dict | None = None, key: str = "rows") -> None:
        """Append `row` to the record's `key` list and print it as one JSON line, then save;
        None only saves (another part of the record changed). A benchmark's row callback."""
        if row is not None:
            self.record.setdefault(key, []).append(row)
            print(json.dumps(row, default=str), flush=True)
        self.save()


def add_subcommand(subparsers, name: str, help: str, add_options: Callable[[argparse.ArgumentParser], None],
                   command: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """`orca-jax bench NAME`: its options, its command, and the parser's own flags, which the
    record's command line spells (`environment.command_from_args`)."""
    parser = subparsers.add_parser(name, help=help)
    add_options(parser)
    parser.set_defaults(func=command, bench_options=options_by_dest(parser))
    return parser


def progress_line(line: str) -> None:
    print(line, flush=True)


def run_benchmark(args: argparse.Namespace, run: Callable[..., dict], settings: Any,
                  format_report: Callable[[dict], str]) -> dict | None:
    """`run(settings, command, progress=...)`, its report printed and its record written to
    `args.json`. A run that did not do what was asked (`BenchmarkError`: a request failed, a
    length is off, counters disagree) prints why and gives None, for exit status 1."""
    from orca_jax.bench.driver import BenchmarkError
    from orca_jax.bench.environment import command_from_args

    name = args.bench_command
    try:
        record = run(settings, command_from_args(name, args), progress=progress_line)
    except BenchmarkError as exc:
        print(f"orca-jax bench {name}: {exc}", file=sys.stderr)
        return None
    print(format_report(record))
    write_json(record, args.json)
    return record
