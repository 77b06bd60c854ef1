"""The option types and shared options of every benchmark: `orca-jax bench ...` and the
scripts in benchmarks/ parse their options with these, so that `--rates 1,2` or
`--batch-sizes 1,16` mean the same everywhere and a bad value gets the same message.

A list option is comma-separated (`--num-seqs 16,64`); the types return tuples, so that a
parsed value is also a valid default of a frozen settings dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any


# ---- option types -------------------------------------------------------------------------
def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _converted(text: str, convert: Callable[[str], Any], message: str) -> tuple:
    """Every comma-separated item of `text` through `convert`; `message` if one does not convert."""
    try:
        return tuple(convert(item) for item in _items(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{message}, got {text!r}") from None


def positive_floats(text: str) -> tuple[float, ...]:
    """At least one number, each > 0 (arrival rates)."""
    values = _converted(text, float, "must be comma-separated numbers")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"must be positive numbers, at least one, got {text!r}")
    return values


def sizes(text: str) -> tuple[int, ...]:
    """Integers >= 1; '' for none (a part of a benchmark left out)."""
    values = _converted(text, int, "must be comma-separated integers")
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be positive integers (>= 1), got {text!r}")
    return values


def nonempty_sizes(text: str) -> tuple[int, ...]:
    """Integers >= 1, at least one."""
    values = sizes(text)
    if not values:
        raise argparse.ArgumentTypeError(f"must be positive integers, at least one, got {text!r}")
    return values


def numbers(text: str) -> tuple[float, ...]:
    """Any numbers, at least one."""
    values = _converted(text, float, "must be comma-separated numbers, at least one")
    if not values:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, at least one, got {text!r}")
    return values


def names(text: str) -> tuple[str, ...]:
    """Names; '' for none. Which names are valid is the settings' to say."""
    return tuple(_items(text))


def choice_list(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """Names among `allowed`, at least one, each once in the order given."""
    def parse(text: str) -> tuple[str, ...]:
        values = _items(text)
        if not values or any(v not in allowed for v in values):
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (comma-separated), got {text!r}")
        return tuple(dict.fromkeys(values))
    parse.__name__ = "choice_list"  # argparse names the type in its error message
    return parse


def int_range(text: str) -> tuple[int, int]:
    """LOW,HIGH with 1 <= LOW <= HIGH."""
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def fractions(text: str) -> tuple[float, ...]:
    """Shares in [0, 1] with 0 among them (the baseline of the ratios)."""
    values = _converted(text, float, "fractions must be comma-separated numbers")
    if 0.0 not in values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"fractions must lie in [0, 1] and include 0, got {text!r}")
    return values


# ---- options ----------------------------------------------------------------------------
def shown(value: Any) -> str:
    """A default as a user would type it: lists comma-separated, floats without trailing zeros."""
    if isinstance(value, (list, tuple)):
        return ",".join(shown(v) for v in value) or "''"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def add_setting(parser: argparse.ArgumentParser, flag: str, help: str, *, defaults: Any, field: str | None = None,
                default_from_settings: bool = True, **kwargs) -> None:
    """An option that sets the field `field` (from the flag's name by default) of a settings
    dataclass, whose value in `defaults` is the default and is named at the end of the help.

    `default_from_settings=False` leaves the parsed default None, for a benchmark whose base
    settings depend on another flag (`--quick`): `settings_from_args` then keeps the base's."""
    field = field or flag.lstrip("-").replace("-", "_")
    if field not in {f.name for f in dataclasses.fields(defaults)}:
        raise AssertionError(f"{flag}: {type(defaults).__name__} has no field {field!r}")
    value = getattr(defaults, field)
    if kwargs.get("action") is argparse.BooleanOptionalAction:
        help = f"{help} (default: {'on' if value else 'off'})"
    else:
        help = f"{help} (default {shown(value)})"
    parser.add_argument(flag, dest=field, default=value if default_from_settings else None, help=help, **kwargs)


def settings_adder(parser: argparse.ArgumentParser, defaults: Any, *,
                   default_from_settings: bool = True) -> Callable[..., None]:
    """`add_setting` bound to one parser and one settings instance: `setting(flag, help, **kwargs)`."""
    return functools.partial(add_setting, parser, defaults=defaults, default_from_settings=default_from_settings)


def add_model_option(parser: argparse.ArgumentParser, *, what: str = "HF directory or .gguf file") -> None:
    parser.add_argument("--model", default=None, help=f"{what} (default: the embedded SmolLM2)")


def add_json_option(parser: argparse.ArgumentParser, default: str | None, *flags: str) -> None:
    """Where the JSON record goes; '' (or no default) writes none."""
    help = "output JSON ('' for none)" if default else "write every number here as JSON"
    parser.add_argument(*(flags or ("--json",)), dest="json", default=default, help=help)


def settings_from_args(base: Any, args: argparse.Namespace, **overrides) -> Any:
    """`base` (a settings dataclass) with every field that an option of the same name set,
    and `overrides` last. An option left None keeps the base's value."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(base)
             if getattr(args, f.name, None) is not None}
    return dataclasses.replace(base, **{**given, **overrides})


def options_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each option by its destination (`switch_interval_s` -> the `--switch-interval` option),
    so that a recorded command spells flags that parse back. argparse keeps its options only
    in `_actions`, its one list of them."""
    return {action.dest: action for action in parser._actions if action.option_strings and action.dest != "help"}
