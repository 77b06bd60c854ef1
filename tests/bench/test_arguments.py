"""The benchmarks' shared option types and settings options (orca_jax/bench/arguments.py)."""

import argparse
import dataclasses

import pytest

from orca_jax.bench import arguments as a


@pytest.mark.parametrize("parse, text, value", [
    (a.positive_floats, "0.5, 2", (0.5, 2.0)),
    (a.sizes, "", ()),
    (a.sizes, "1,16", (1, 16)),
    (a.nonempty_sizes, "4", (4,)),
    (a.numbers, "-1,3", (-1.0, 3.0)),
    (a.names, "a,,b", ("a", "b")),
    (a.choice_list(("x", "y")), "y,x,y", ("y", "x")),
    (a.int_range, "2,5", (2, 5)),
    (a.fractions, "0,0.5,1", (0.0, 0.5, 1.0)),
])
def test_list_types_parse_into_tuples(parse, text, value):
    assert parse(text) == value


@pytest.mark.parametrize("parse, text", [
    (a.positive_int, "0"), (a.non_negative_int, "-1"), (a.positive_float, "0"),
    (a.positive_floats, ""), (a.positive_floats, "1,-2"), (a.positive_floats, "x"),
    (a.sizes, "1,0"), (a.sizes, "one"), (a.nonempty_sizes, ""), (a.numbers, "a"),
    (a.choice_list(("x",)), "x,z"), (a.choice_list(("x",)), ""),
    (a.int_range, "5,2"), (a.int_range, "3"), (a.fractions, "0.5,1"), (a.fractions, "0,2"),
])
def test_bad_values_are_refused(parse, text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)


@dataclasses.dataclass(frozen=True)
class Settings:
    rounds: int = 3
    batch_sizes: tuple[int, ...] = (1, 16)
    switch_interval_s: float = 0.0001
    overlap: bool = True
    model: str | None = None


def test_a_setting_defaults_to_its_field_and_names_the_default_in_its_help():
    p = argparse.ArgumentParser()
    d = Settings()
    a.add_setting(p, "--rounds", "rounds", defaults=d, type=a.positive_int)
    a.add_setting(p, "--batch-sizes", "batches", defaults=d, type=a.sizes)
    a.add_setting(p, "--switch-interval", "interval", defaults=d, field="switch_interval_s", type=float)
    a.add_setting(p, "--overlap", "overlap", defaults=d, action=argparse.BooleanOptionalAction)
    help = p.format_help()
    assert "(default 3)" in help and "(default 1,16)" in help and "(default 0.0001)" in help
    assert "(default: on)" in help
    args = p.parse_args(["--switch-interval", "0.5", "--no-overlap"])
    assert (args.rounds, args.batch_sizes, args.switch_interval_s, args.overlap) == (3, (1, 16), 0.5, False)


def test_a_setting_must_name_a_field_of_the_settings():
    with pytest.raises(AssertionError, match="no field 'roundz'"):
        a.add_setting(argparse.ArgumentParser(), "--roundz", "typo", defaults=Settings())


def test_settings_from_args_keep_the_base_where_an_option_was_left_none():
    p = argparse.ArgumentParser()
    a.add_setting(p, "--rounds", "rounds", defaults=Settings(), type=int, default_from_settings=False)
    a.add_setting(p, "--batch-sizes", "batches", defaults=Settings(), type=a.sizes, default_from_settings=False)
    quick = Settings(rounds=1, batch_sizes=(2,))
    args = p.parse_args(["--rounds", "7"])
    assert a.settings_from_args(quick, args) == Settings(rounds=7, batch_sizes=(2,))
    assert a.settings_from_args(quick, args, model="m").model == "m"


def test_options_by_dest_give_the_flag_that_sets_each_destination():
    p = argparse.ArgumentParser()
    p.add_argument("--switch-interval", dest="switch_interval_s")
    p.add_argument("--out", "--json", dest="json")
    options = a.options_by_dest(p)
    assert options["switch_interval_s"].option_strings[0] == "--switch-interval"
    assert options["json"].option_strings[0] == "--out" and "help" not in options
