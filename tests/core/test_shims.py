"""The previous release's import paths still work for one release: each shim gives the names of the
module that moved, and warns once (``DeprecationWarning``) naming the new import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: old path -> (new module, a name the docs taught from the old path)
SHIMS = {
    "cloudevents": ("delivery_consumer.model.cloudevents", "parse_message"),
    "contract": ("delivery_consumer.model.contract", "ConsumerSpec"),
    "envelope": ("delivery_consumer.model.envelope", "Envelope"),
    "errors": ("delivery_consumer.model.errors", "Rejection"),
    "event_ids": ("delivery_consumer.model.event_ids", "new_event_id"),
    "event_types": ("delivery_consumer.model.event_types", "EventTypes"),
    "faults": ("delivery_consumer.model.faults", "crashpoint"),
    "producer": ("delivery_consumer.outbox.demo_producer", "open_db"),
    "sqlite": ("delivery_consumer.store.sqlite", "connect"),
    "state": ("delivery_consumer.model.state", "RevisionTable"),
    "typed": ("delivery_consumer.model.typed", "envelope"),
    "views": ("delivery_consumer.inbox.views", "list_rows"),
}

SCRIPT = """
import importlib, json, sys, warnings
old, new, taught = sys.argv[1:]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    shim = importlib.import_module("delivery_consumer." + old)
    importlib.import_module("delivery_consumer." + old)
    exec("from delivery_consumer.%s import %s" % (old, taught))
moved = importlib.import_module(new)
names = getattr(moved, "__all__", None) or [n for n in vars(moved) if not n.startswith("_")]
print(json.dumps({
    "warnings": [(w.category.__name__, str(w.message)) for w in caught],
    "missing": [n for n in names if getattr(shim, n, None) is not getattr(moved, n)],
    "taught": getattr(shim, taught) is getattr(moved, taught),
}))
"""


@pytest.mark.parametrize("old", sorted(SHIMS))
def test_an_old_path_gives_the_moved_names_and_warns_once(old: str) -> None:
    """Importing the old path (twice, and a name from it) warns exactly once, with the new import in
    the message; every public name of the moved module is the very object through the old path."""
    new, taught = SHIMS[old]
    done = subprocess.run([sys.executable, "-c", SCRIPT, old, new, taught], capture_output=True, text=True,
                          timeout=60, check=True)
    found = json.loads(done.stdout)
    assert [] == found["missing"]
    assert found["taught"]
    ((category, message),) = found["warnings"]
    assert "DeprecationWarning" == category
    assert f"delivery_consumer.{old} is deprecated" in message
    assert new in message
