"""Which JSON Schema validator: fastjsonschema against jsonschema, same envelopes.

    python bench/bench_validate.py [--events 20000] [--repeat 5]

Validates the same envelopes (the realistic stream of ``_stream.py`` plus a
few hundred invalid ones, one schema violation each) against
``schemas/envelope.schema.json``:

* fastjsonschema: the envelope schema compiled to Python as the project
  compiles each type's (``event_types.py``: ``use_default=False``, the
  ``date-time`` format checked by ``envelope.is_rfc3339``);
* the project's actual path: the type's quick check
  (``event_types.quick_check``: generated for the type's shape, it only ever
  answers "certainly valid"), found by the type, and the type's envelope
  schema compiled the same way for whatever it does not accept (an
  unknown type: the schema file's);
* jsonschema: ``Draft7Validator`` built once, with a ``FormatChecker``. The
  checker gets the same ``is_rfc3339`` for ``date-time``: without the optional
  ``rfc3339-validator`` package jsonschema silently skips that format, and
  the comparison must check the same rules. Timed two ways: ``validate()``
  (raises the best-matching error, what a consumer needs for its rejection
  reason) and ``is_valid()`` (yes/no only, its fastest use).

Both must agree on which envelopes are valid. Reports the best of
``--repeat`` runs in µs per envelope (validation only: the dicts are decoded
beforehand) and the ratio, and what importing each library adds to a
process's start-up (best of 5 fresh interpreters, bytecode cached).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import _stream
import fastjsonschema
import jsonschema
from jsonschema import Draft7Validator, FormatChecker

from delivery_consumer.model import envelope


def _as_check(validate: Callable[[Any], object], invalid: type[Exception]) -> Callable[[Any], bool]:
    """*validate*, which raises *invalid* for an envelope it refuses, as a yes/no check."""

    def check(obj: Any) -> bool:
        try:
            validate(obj)
        except invalid:
            return False
        return True

    return check


def _compiled(schema: dict[str, Any]) -> Callable[[Any], bool]:
    """*schema* compiled with the options the project compiles each type's with."""
    validate = fastjsonschema.compile(schema, formats={"date-time": envelope.is_rfc3339}, use_default=False)
    return _as_check(validate, fastjsonschema.JsonSchemaValueException)


def _fastjsonschema() -> Callable[[Any], bool]:
    return _compiled(envelope.load_schema())


def _project() -> Callable[[Any], bool]:
    from delivery_consumer.model.event_types import MATERIAL, quick_check

    quick = {t.name: quick_check(t) for t in MATERIAL}
    typed = {t.name: _compiled(t.envelope_schema()) for t in MATERIAL}
    fallback = _fastjsonschema()

    def check(obj: Any) -> bool:
        kind = obj.get("type")
        fast = quick.get(kind) if type(kind) is str else None
        if fast is not None and fast(obj):
            return True
        slow = typed.get(kind) if type(kind) is str else None
        return (slow or fallback)(obj)

    return check


def _jsonschema_validator() -> Draft7Validator:
    checker = FormatChecker()
    checker.checks("date-time")(envelope.is_rfc3339)
    schema = envelope.load_schema()
    Draft7Validator.check_schema(schema)
    return Draft7Validator(schema, format_checker=checker)


def _jsonschema_validate() -> Callable[[Any], bool]:
    return _as_check(_jsonschema_validator().validate, jsonschema.ValidationError)


def _jsonschema_is_valid() -> Callable[[Any], bool]:
    return _jsonschema_validator().is_valid


def _best(check: Callable[[Any], bool], objs: list[Any], repeat: int) -> tuple[float, list[bool]]:
    best = float("inf")
    verdicts: list[bool] = []
    for _ in range(repeat):
        start = time.perf_counter()
        verdicts = [check(obj) for obj in objs]
        best = min(best, time.perf_counter() - start)
    return best, verdicts


def _import_ms(module: str) -> float:
    """Start-up a fresh interpreter spends importing *module* (best of 5)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = cache

        def best(code: str) -> float:
            times = []
            for _ in range(6):  # the first run fills the bytecode cache
                start = time.perf_counter()
                subprocess.run([sys.executable, "-c", code], env=env, check=True)
                times.append(time.perf_counter() - start)
            return min(times[1:])

        return (best(f"import {module}") - best("pass")) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5, help="runs per validator; the best is reported")
    args = parser.parse_args()

    valid = _stream.envelopes(args.events)
    invalid = _stream.invalid_envelopes(valid)
    objs = valid + invalid
    print(f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"fastjsonschema {fastjsonschema.VERSION}, jsonschema {_version('jsonschema')}; "
          f"{len(valid)} valid + {len(invalid)} invalid envelopes, best of {args.repeat}")

    candidates = {
        "fastjsonschema (the envelope schema, compiled)": _fastjsonschema,
        "project path: quick check, else fastjsonschema": _project,
        "jsonschema Draft7Validator.validate (built once)": _jsonschema_validate,
        "jsonschema Draft7Validator.is_valid (built once)": _jsonschema_is_valid,
    }
    timings: dict[str, float] = {}
    reference: list[bool] | None = None
    for name, make in candidates.items():
        start = time.perf_counter()
        check = make()
        setup = time.perf_counter() - start
        seconds, verdicts = _best(check, objs, args.repeat)
        if reference is None:
            reference = verdicts
        elif verdicts != reference:
            diff = sum(a != b for a, b in zip(verdicts, reference, strict=True))
            raise SystemExit(f"{name} disagrees with fastjsonschema on {diff} envelopes")
        timings[name] = seconds
        print(f"  {name:<52} {seconds / len(objs) * 1e6:7.2f} µs/event  (set-up {setup * 1000:.0f} ms)")
    assert reference is not None
    print(f"  agree on all {len(objs)}: {reference.count(True)} valid, {reference.count(False)} invalid")
    fast = timings[next(iter(candidates))]
    for name in list(candidates)[1:]:
        print(f"  {name.split(' (')[0].split(':')[0]}: {timings[name] / fast:.2f}x the time of fastjsonschema")
    for module in ("fastjsonschema", "jsonschema"):
        print(f"  import {module}: +{_import_ms(module):.0f} ms of start-up")


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    main()
