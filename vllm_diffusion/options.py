"""Typed option parsing shared by engine-wide and per-request configuration: every option set
is a frozen dataclass whose fields carry their validation ``Rule`` in ``metadata["rule"]``;
errors name the option and what is valid."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class OptionError(ValueError):
    """An option is unknown, of the wrong type, or out of range."""


ECHO_LIMIT = 80  # characters of a client's value repeated in an error message


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, cut to ``ECHO_LIMIT`` characters (a client's
    value can be megabytes long)."""
    text = repr(value)
    if len(text) <= ECHO_LIMIT:
        return text
    return f"{text[:ECHO_LIMIT]}... ({len(text)} characters)"


LISTED_LIMIT = 5  # items of a client's list named in an error message


def listed(values: Iterable[Any]) -> str:
    """The first ``LISTED_LIMIT`` values, each ``shown``, and how many more there are (a
    client can send ten thousand unknown keys)."""
    values = list(values)
    head = ", ".join(shown(v) for v in values[:LISTED_LIMIT])
    more = len(values) - LISTED_LIMIT
    return f"{head} and {more} more" if more > 0 else head


def refuse_unknown(given: Iterable[str], valid: Iterable[str], source: str,
                   valid_for: str = "") -> None:
    """Raise ``OptionError`` naming the keys of ``given`` outside ``valid`` (the first
    few and a count) and the valid ones; ``valid_for``: what they are valid for."""
    valid = set(valid)
    unknown = sorted(set(given) - valid, key=repr)
    if unknown:
        raise OptionError(f"{source}: unknown option(s) {listed(unknown)}; valid options"
                          f"{valid_for} are {', '.join(sorted(valid))}")


@dataclasses.dataclass(frozen=True)
class Rule:
    # int, float, str or bool; tuple: a list of ints (each within low..high), given as a
    # JSON list or a comma-separated string
    kind: type
    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    choices: tuple[str, ...] | None = None
    optional: bool = False  # None is allowed

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        parts = ["a list of int" if self.kind is tuple else self.kind.__name__]
        if self.low is not None or self.high is not None:
            lo = "-inf" if self.low is None else self.low
            hi = "inf" if self.high is None else self.high
            parts.append(f"in {'[' if self.low_inclusive else '('}{lo}, {hi}]")
        if self.optional:
            parts.append("or null")
        return " ".join(parts)

    def check(self, name: str, value: Any, source: str) -> Any:
        must = f"{source}: option '{name}' must be"
        if value is None:
            if self.optional:
                return None
            raise OptionError(f"{must} {self.describe()}, got null")
        if self.kind is tuple:
            return self._check_int_list(name, value, source)
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:
                raise OptionError(f"{must} {self.describe()}, "
                                  f"got an integer too large for a float") from None
        if isinstance(value, str) and self.kind is bool and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        # The OpenAI server's vllm_xargs holds str | int | float: a JSON true arrives as 1.
        if self.kind is bool and type(value) is int and value in (0, 1):
            value = bool(value)
        if isinstance(value, str) and self.kind in (int, float):
            with contextlib.suppress(ValueError):
                value = self.kind(value)
        if not isinstance(value, self.kind) or (self.kind is int and isinstance(value, bool)):
            raise OptionError(f"{must} {self.describe()}, got {shown(value)}")
        # NaN compares false with every bound, so range checks alone would admit it.
        if self.kind is float and not math.isfinite(value):
            raise OptionError(f"{must} a finite {self.describe()}, got {shown(value)}")
        if ((self.choices is not None and value not in self.choices)
                or (self.low is not None and (value < self.low if self.low_inclusive
                                              else value <= self.low))
                or (self.high is not None and value > self.high)):
            raise OptionError(f"{must} {self.describe()}, got {shown(value)}")
        return value

    def _check_int_list(self, name: str, value: Any, source: str) -> tuple[int, ...]:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not items:
            raise OptionError(f"{source}: option '{name}' must be {self.describe()}, "
                              f"got {shown(value)}")
        item_rule = dataclasses.replace(self, kind=int, optional=False)
        return tuple(item_rule.check(name, item.strip() if isinstance(item, str) else item,
                                     source) for item in items)


def option(default: Any, rule: Rule) -> Any:
    return dataclasses.field(default=default, metadata={"rule": rule})


def option_value(cls: type, options: Mapping[str, Any], name: str) -> Any:
    """``options[name]`` as the option's rule parses it (a bad value raises
    ``OptionError`` naming it), or its default where absent: for ``traits``, which may see
    options as given, before they are parsed."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if name not in options:
        return field.default
    return field.metadata["rule"].check(name, options[name], "options")


def option_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def parse_options(cls: type[T], values: Mapping[str, Any], *, source: str,
                  base: T | None = None) -> T:
    """Build ``cls`` from ``values`` (all keys must be fields of ``cls``); ``base``
    supplies the values of fields that ``values`` does not mention."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    refuse_unknown(values, known, source)
    checked = {name: known[name].metadata["rule"].check(name, value, source)
               for name, value in values.items()}
    return cls(**checked) if base is None else dataclasses.replace(base, **checked)
