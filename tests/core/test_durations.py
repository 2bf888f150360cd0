"""One duration grammar: parse and format are inverses, and every duration option of the CLI uses it."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import cli

from delivery_consumer.cli import main
from delivery_consumer.cli.duration_type import Duration
from delivery_consumer.model import durations

#: Option names that say "this is a time": every such option must be a Duration.
TIME_WORDS = re.compile(r"timeout|delay|idle|lease|wait|older|horizon|poll|retry-base|retry-cap|interval|"
                        r"(?<!man)age|ttl|window")  # (--management-url is no age)


@pytest.mark.parametrize(("text", "seconds"), [
    ("250ms", 0.25), ("45s", 45), ("90m", 5400), ("12h", 43200), ("30d", 2_592_000), ("2w", 1_209_600),
    ("2", 2), ("0.5", 0.5), ("1.5h", 5400), (" 7D ", 604_800), ("0", 0), ("10 ms", 0.01), (".5s", 0.5),
])
def test_the_grammar(text: str, seconds: float) -> None:
    """Every unit of the grammar, and a bare number, mean what they say."""
    assert seconds == durations.parse(text)


@pytest.mark.parametrize("text", ["", "soon", "-1s", "1e3", "nan", "inf", "3 days", "d", "1.s", "5y", "1s2", "1,5s"])
def test_anything_else_is_refused_with_the_one_message(text: str) -> None:
    """A spelling outside the grammar is a ValueError with the one message."""
    with pytest.raises(ValueError) as info:
        durations.parse(text)

    assert durations.error_message(text) == str(info.value)


def test_format_writes_the_largest_whole_unit_up_to_days() -> None:
    """format() picks the unit an operator would write."""
    assert ["7d", "90m", "12h", "250ms", "45s", "0s", "1.0005s"] == [
        durations.format(s) for s in (604_800, 5400, 43200, 0.25, 45, 0, 1.0005)]


@given(st.floats(min_value=0, allow_infinity=False, allow_nan=False))
def test_parse_undoes_format(seconds: float) -> None:
    """parse(format(x)) == x for every finite x >= 0."""
    assert seconds == durations.parse(durations.format(seconds))


@given(st.integers(0, 10**9) | st.decimals(0, 10**6, places=3, allow_nan=False, allow_infinity=False),
       st.sampled_from(["", *durations.UNITS_MS]))
def test_format_undoes_parse(number: object, unit: str) -> None:
    """Any spelling of the grammar survives parse -> format -> parse, with the same value."""
    seconds = durations.parse(f"{number}{unit}")

    assert math.isfinite(seconds)
    assert seconds == durations.parse(durations.format(seconds))


def commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """Every command of the CLI (lazy groups loaded), with its path."""
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))
        else:
            yield (*path, name), command


def duration_options() -> list[tuple[tuple[str, ...], click.Option]]:
    return [(path, param) for path, command in commands(main) for param in command.params
            if isinstance(param, click.Option) and any(TIME_WORDS.search(o) for o in param.opts)]


def test_every_duration_option_uses_the_duration_type() -> None:
    """Each option whose name says it is a time is parsed by the one Duration type."""
    found = duration_options()
    names = {o for _, param in found for o in param.opts}

    assert {"--retry-delays", "--lease", "--older-than", "--exit-when-idle", "--retry-cap", "--horizon",
            "--batch-wait", "--webhook-read-timeout", "--timeout", "--window"} <= names
    assert [] == [(path, param.opts) for path, param in found if not isinstance(param.type, Duration)]


@pytest.mark.parametrize(("path", "option"), [(p, o.opts[0]) for p, o in duration_options()],
                         ids=lambda v: " ".join(v) if isinstance(v, tuple) else v)
def test_every_duration_option_refuses_a_bad_value_with_the_one_message(path: tuple[str, ...], option: str) -> None:
    """A bad value of any duration option: exit 2 and the same message, before anything runs."""
    result = cli([*path, option, "soon"])

    assert 2 == result.exit_code
    assert durations.error_message("soon") in result.output


@pytest.mark.parametrize("seconds, shown", [(None, "-"), (-3, "0s"), (59.9, "59s"), (376, "6m 16s"),
                                            (3 * 3600 + 300, "3h 5m"), (2 * 86400 + 7200, "2d 2h")])
def test_an_age_for_a_person_has_two_units_at_most(seconds: float | None, shown: str) -> None:
    """status, inbox stats and the console show elapsed times the same way."""
    assert shown == durations.age(seconds)


@pytest.mark.parametrize("option", ["--lease", "--poll", "--retry-base", "--retry-cap"])
def test_a_zero_dispatch_duration_is_refused_naming_its_option(option: str) -> None:
    """dispatch --lease 0 said 'lease, poll, retry and heartbeat durations must be positive' without
    saying which option was wrong; the option itself refuses zero now."""
    result = cli(["dispatch", "--db", "unused.db", option, "0"])
    assert 2 == result.exit_code
    assert f"Invalid value for '{option}': 0 is out of range: more than 0s" in result.output


def test_the_console_window_is_a_positive_duration_and_hours_an_alias(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """console --window refuses zero; the deprecated --hours still sets the window, saying so,
    before the console looks for its deployment file."""
    monkeypatch.chdir(tmp_path)
    refused = cli(["console", "--window", "0"])
    assert 2 == refused.exit_code
    assert "Invalid value for '--window': 0 is out of range: more than 0s" in refused.output

    alias = cli(["console", "--hours", "1.5"])
    assert 2 == alias.exit_code
    assert "--hours is deprecated: use --window 90m" in alias.output
    assert "no deployment file" in alias.output
