"""Several broker addresses on the command line: ``--amqp-url`` repeated, a comma list, a URL with several hosts,
``DELIVERY_AMQP_URL`` as a list and ``amqp_url = [..]`` in the deployment file all give every node (none silently
dropped), tried in turn; ``--amqp-order`` / ``amqp_order`` choose the order."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from brokerkit import Namespace, free_port
from support import cli, new_event

Ways = Callable[[Path, str, str], tuple[list[str], dict[str, str]]]


def option_repeated(_: Path, a: str, b: str) -> tuple[list[str], dict[str, str]]:
    return ["--amqp-url", a, "--amqp-url", b], {}


def comma_list(_: Path, a: str, b: str) -> tuple[list[str], dict[str, str]]:
    return ["--amqp-url", f"{a},{b}"], {}


def environment(_: Path, a: str, b: str) -> tuple[list[str], dict[str, str]]:
    return [], {"DELIVERY_AMQP_URL": f"{a},{b}"}


def environment_spaces(_: Path, a: str, b: str) -> tuple[list[str], dict[str, str]]:
    return [], {"DELIVERY_AMQP_URL": f"{a} {b}"}


def deployment_list(tmp: Path, a: str, b: str) -> tuple[list[str], dict[str, str]]:
    (tmp / "delivery.toml").write_text(f'amqp_url = ["{a}", "{b}"]\namqp_order = "in-order"\n')
    # amqp_order sets DELIVERY_AMQP_ORDER for the command: named here, the in-process runner restores it
    return ["--config", str(tmp / "delivery.toml")], {"DELIVERY_AMQP_ORDER": ""}


WAYS = [option_repeated, comma_list, environment, environment_spaces, deployment_list]


def event_file(tmp: Path) -> str:
    path = tmp / "events.jsonl"
    path.write_bytes(orjson.dumps(new_event()) + b"\n")
    return str(path)


@pytest.mark.parametrize("way", WAYS, ids=lambda w: w.__name__)
def test_every_way_of_giving_two_addresses_tries_both(tmp_path: Path, way: Ways) -> None:
    """Two nodes that refuse, given each way: the command tries both and its one line names both (and no
    password) -- neither is dropped nor read as one odd URL ("access denied")."""
    p1, p2 = free_port(), free_port()
    args, env = way(tmp_path, f"amqp://guest:s3cret@127.0.0.1:{p1}/%2F", f"amqp://guest:s3cret@127.0.0.1:{p2}/%2F")
    result = cli(["publish", "--attempts", "1", *args, event_file(tmp_path)], env=env)
    assert 2 == result.exit_code, result.output
    assert "no broker address answered" in result.output, result.output
    assert f"127.0.0.1:{p1}" in result.output and f"127.0.0.1:{p2}" in result.output, result.output
    assert "s3cret" not in result.output and "access denied" not in result.output


def test_a_url_with_several_hosts_tries_each_host(tmp_path: Path) -> None:
    """``amqp://user:password@h1:p1,h2:p2/vhost``: both hosts, each with the user and vhost."""
    p1, p2 = free_port(), free_port()
    result = cli(["publish", "--attempts", "1", "--amqp-url", f"amqp://guest:s3cret@127.0.0.1:{p1},127.0.0.1:{p2}/%2F",
                  event_file(tmp_path)])
    assert 2 == result.exit_code
    assert f"amqp://guest@127.0.0.1:{p1}//, amqp://guest@127.0.0.1:{p2}//" in result.output, result.output


def test_an_unknown_order_is_refused(tmp_path: Path) -> None:
    """--amqp-order takes in-order or shuffle; amqp_order in the deployment file likewise, naming the key."""
    result = cli(["publish", "--amqp-order", "random", event_file(tmp_path)], env={"DELIVERY_AMQP_ORDER": ""})
    assert 2 == result.exit_code and "in-order" in result.output
    (tmp_path / "delivery.toml").write_text('amqp_order = "random"\n')
    result = cli(["--config", str(tmp_path / "delivery.toml"), "publish", event_file(tmp_path)])
    assert 2 == result.exit_code and "amqp_order" in result.output, result.output


@pytest.mark.parametrize("way", WAYS, ids=lambda w: w.__name__)
def test_the_first_address_dead_the_command_uses_the_second(ns: Namespace, way: Ways) -> None:
    """A refused node first, the broker second, given each way: the command reaches the broker at once (its
    message is answered: returned, as nothing is bound in this namespace)."""
    args, env = way(ns.workdir, f"amqp://guest:guest@127.0.0.1:{free_port()}/%2F", ns.url)
    base = ns.env()
    del base["DELIVERY_AMQP_URL"]  # the namespace's own URL: only the way under test names the broker
    result = ns.cli("publish", "--json", "--attempts", "1", "--amqp-order", "in-order", *args,
                    event_file(ns.workdir), env={**base, **env})
    assert ["returned"] == [orjson.loads(line)["published"] for line in result.stdout.splitlines()], result.stderr


def test_shuffled_every_attempt_still_finds_the_live_node(ns: Namespace) -> None:
    """--amqp-order shuffle with one live node among dead ones: every command reaches it."""
    dead = [f"amqp://guest:guest@127.0.0.1:{free_port()}/%2F" for _ in range(3)]
    for _ in range(3):
        result = ns.cli("publish", "--json", "--attempts", "1", "--amqp-order", "shuffle",
                        "--amqp-url", ",".join([*dead[:2], ns.url, dead[2]]), event_file(ns.workdir))
        assert ["returned"] == [orjson.loads(line)["published"] for line in result.stdout.splitlines()], \
            result.stderr
