"""What every benchmark record says about where it ran (orca_jax/bench/environment.py)."""

import argparse
import shlex

import pytest

from orca_jax.bench import environment


def test_cpu_flags_are_the_vector_and_matrix_extensions_of_the_flags_line():
    cpuinfo = "processor : 0\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile f16c\nbugs : x\n"
    assert environment.cpu_flags(cpuinfo) == ["amx_tile", "avx2", "avx512_bf16", "avx512f", "f16c", "fma"]
    assert environment.cpu_flags("processor : 0\n") == []


def test_the_record_header_names_the_benchmark_command_date_machine_flags_and_commit():
    header = environment.record_header("x", "orca-jax bench x", date="2026-01-01T00:00:00+00:00")
    assert list(header) == ["benchmark", "command", "date", "machine"]
    machine = header["machine"]
    assert machine["cpu_count"] >= 1 and machine["jax"] and isinstance(machine["cpu_flags"], list)
    assert machine["orca_jax"]["path"] and header["date"].startswith("2026")
    # Versions come from the installed metadata: reading them must not import torch.
    assert "torch" in machine and "transformers" in machine


def test_every_bench_subcommands_recorded_command_parses_back_to_the_same_options():
    """The record's command reproduces the run: every default spelled out, with the parser's own
    flags (a renamed destination such as --switch-interval, a --no-x switch)."""
    from orca_jax.bench.cli import SUBCOMMANDS
    from orca_jax.cli import build_parser

    parser = build_parser()
    extra = {"offline": ["--no-async-scheduling", "--skip-peers"], "structured": ["--no-sync-baseline"],
             "spec": ["--switch-interval", "0.01", "--ngram-k", ""], "quant": ["--settle", "1", "--no-serve-parallel"],
             "prefix": ["--n", "0"], "host": ["--max-model-len", "64"]}
    for name, *_ in SUBCOMMANDS:
        args = parser.parse_args(["bench", name, *extra.get(name, [])])
        command = environment.command_from_args(name, args)
        again = parser.parse_args(shlex.split(command)[1:])
        first = {k: v for k, v in vars(args).items() if k not in ("func", "bench_options")}
        assert {k: v for k, v in vars(again).items() if k not in ("func", "bench_options")} == first, name


@pytest.mark.parametrize("value, words", [(True, ["--flag"]), (False, []), ((1, 2), ["--flag", "1,2"])])
def test_a_command_without_the_parsers_flags_derives_them_from_the_names(value, words):
    args = argparse.Namespace(flag=value, func=None)
    assert shlex.split(environment.command_from_args("x", args)) == ["orca-jax", "bench", "x", *words]
