"""deploy/'s alert rules and dashboard queries, evaluated by ``promtool test rules``
on series recorded from real scrapes of real processes: ``run`` (an active one
and its standby, which waits for the partition's database and is not attached
to the broker meanwhile), ``dispatch``, and RabbitMQ's own Prometheus endpoint
(a private node: the shared broker has no plugin, and this test stops its
broker). Each alert fires in its scenario, with the labels it must carry, and
no alert fires in the healthy one (nor for the waiting standby in any)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pika
import pytest
import yaml
from alertkit import DETAILED, PrivateBroker, Scrape, Target, Timeline, promtool_test, scrape, target
from alertkit import prometheus_plugin_missing as plugin_missing
from brokerkit import Namespace, RunProcess, kill, session_processes
from partitionkit import Cluster
from support import REPO, new_event, wait_until
from webhook_server import free_port

from delivery_consumer import outbox

RULES = REPO / "deploy" / "prometheus" / "delivery-consumer.rules.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "delivery-consumer.json"
#: Dashboard variables as Grafana substitutes them with "All" selected.
VARIABLES = {"$consumer": ".*", "$job": ".*", "$__rate_interval": "5m"}
#: The outbox's pending-only age; older dispatchers export the age of any unpublished row instead.
PENDING_AGE = "outbox_oldest_pending_age_seconds"
MAIN, DEAD = "delivery.catalog.p0", "delivery.catalog.p0.dead"

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def needed(why: str | None) -> None:
    """Skip when a tool is missing; under CI (which installs it) fail instead."""
    if why is None:
        return
    if os.environ.get("CI") or os.environ.get("DELIVERY_REQUIRE_BROKER"):
        pytest.fail(why)
    pytest.skip(why)


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def panel_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    for name, value in VARIABLES.items():
        exprs = [expr.replace(name, value) for expr in exprs]
    return exprs


def metric_names(exprs: list[str]) -> set[str]:
    """Every word of the expressions that could be a metric name."""
    return {word for expr in exprs for word in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr)}


@dataclass
class System:
    """The deployment under test: a private broker, the catalog in one partition served by
    an active run and a standby, the producer's database and its dispatcher."""

    workdir: Path
    broker: PrivateBroker
    ns: Namespace = field(init=False)
    cluster: Cluster = field(init=False)
    producer: Path = field(init=False)
    procs: list[RunProcess] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ns = Namespace(self.broker.url, "delivery", self.workdir)  # the broker is ours: default names
        self.cluster = Cluster(self.ns, "catalog", 1)
        self.producer = self.workdir / "producer.db"
        self.ports = {name: free_port() for name in ("active", "standby", "dispatch")}

    def target(self, name: str) -> Target:
        return target("delivery-dispatch" if name == "dispatch" else "delivery-consumer", self.ports[name])

    @property
    def rabbitmq(self) -> Target:
        return target("rabbitmq", self.broker.metrics_port, DETAILED)

    @property
    def targets(self) -> list[Target]:
        return [self.target("active"), self.target("standby"), self.target("dispatch"), self.rabbitmq]

    def start_run(self, name: str) -> RunProcess:
        proc = self.cluster.start(0, "--metrics-port", str(self.ports[name]), "--prefetch", "1", "--batch", "1")
        self.procs.append(proc)
        return proc

    def start_dispatch(self) -> RunProcess:
        proc = RunProcess([sys.executable, "-m", "delivery_consumer", "dispatch", "--db", str(self.producer),
                           "--metrics-port", str(self.ports["dispatch"])], cwd=self.workdir, env=self.ns.env())
        self.procs.append(proc)
        return proc

    def produce(self, article: str) -> None:
        done = self.ns.cli("produce", "--db", str(self.producer), "--article", article, "--title", article,
                           "--url", f"https://example.org/{article}")
        assert 0 == done.returncode, done.stderr

    def settle(self, what: str, ready: Callable[[Scrape], bool], targets: list[Target] | None = None) -> Scrape:
        """Scrape until *ready* holds for a scrape; that scrape."""
        live = [proc for proc in self.procs if proc.returncode is None]
        last: list[Scrape] = []
        def attempt() -> Scrape | None:
            last[:] = [scrape(self.targets if targets is None else targets)]
            return last[0] if ready(last[0]) else None

        try:
            return wait_until(what, attempt, timeout=300, procs=live, interval=0.2)
        except AssertionError as e:
            shown = [f"{name}{dict(labels)} {value}" for (name, labels), value in last[0].samples.items()
                     if re.match(r"up|delivery_(connected|store|queue|events)|outbox_rows|rabbitmq_detailed", name)]
            raise AssertionError(f"{e}\nlast scrape:\n" + "\n".join(shown)) from None

    def labels(self, name: str, *extra: str) -> dict[str, str]:
        """The labels of run *name*'s own series (partition 0 of catalog), with *extra* of them."""
        t = self.target(name)
        return {"consumer": "catalog", "partition": "0", "job": t.job, "instance": t.instance, **{
            key: value for key, value in zip(extra[::2], extra[1::2], strict=True)}}


@pytest.fixture
def system(tmp_path: Path) -> Iterator[System]:
    """A private RabbitMQ node and the processes of a test; everything stopped afterwards."""
    needed(plugin_missing())
    broker = PrivateBroker(tmp_path / "rabbitmq")
    sys_ = System(tmp_path / "work", broker)
    sys_.workdir.mkdir()
    try:
        broker.start()
        yield sys_
    finally:
        for proc in sys_.procs:
            if session_processes(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        broker.stop()


def alert(name: str, **labels: str) -> tuple[str, dict[str, str]]:
    """An expected alert: its labels, the rule's own (severity) included."""
    [rule] = [rule for rule in rules() if rule.get("alert") == name]
    return name, {**rule.get("labels", {}), **labels}


def expect(*alerts: tuple[str, dict[str, str]]) -> dict[str, list[dict[str, str]]]:
    firing: dict[str, list[dict[str, str]]] = {}
    for name, labels in alerts:
        firing.setdefault(name, []).append(labels)
    return firing


@pytest.mark.timeout(900)
def test_every_alert_fires_in_its_scenario_and_stays_silent_in_the_healthy_one(system: System,
                                                                               tmp_path: Path) -> None:
    """Healthy, the standby waiting: no alert. A dead letter, a quarantined row: their alerts.
    Broker down: the active run disconnected and not answering (not the standby), the pending row
    too old; afterwards the active run still holds the partition. Database locked: no commit while
    the backlog grows. Runs and dispatcher killed: down, and the backlog without a consumer from the
    broker's own figures. No target at all: down (absent). A queue the broker cannot serve: unreadable
    (from both runs). A consumer listed that never acks, no run left: the backlog not draining (ghost
    consumers), as it is for a run that commits nothing. The dashboard counts a queue once, active
    and standby."""
    needed(None if subprocess.run(["which", "promtool"], capture_output=True).returncode == 0 else
           "promtool is not installed (Debian package prometheus; .ci/run installs it)")
    s = system
    s.cluster.declare()
    active = s.start_run("active")
    standby = s.start_run("standby")
    for article in ("a1", "a2", "a3"):
        s.produce(article)
    dispatch = s.start_dispatch()
    a, sb, d = s.target("active"), s.target("standby"), s.target("dispatch")
    scenarios: list[tuple[str, Timeline, dict[str, list[dict[str, str]]], list[tuple[str, list[dict[str, Any]]]]]] = []
    seen: list[Scrape] = []

    # Healthy: every event published and applied; nothing waits. The active run is attached;
    # the standby waits for the partition's database, scraped but not attached.
    healthy = s.settle("three events published and applied, the active run attached, the standby waiting",
                       lambda x: (
        x.value("outbox_rows", state="published") == 3
        and x.value("delivery_events_total", outcome="updated", instance=a.instance) == 3
        and x.value("rabbitmq_detailed_queue_messages_ready", queue=MAIN) == 0
        and x.value("rabbitmq_detailed_queue_consumers", queue=MAIN) == 1
        and x.value("delivery_active", instance=a.instance) == 1
        and x.value("delivery_connected", instance=a.instance) == 1
        and x.value("delivery_active", instance=sb.instance) == 0
        and x.value("delivery_connected", instance=sb.instance) == 0))
    seen.append(healthy)
    timeline = Timeline()
    timeline.add(healthy, 30)
    scenarios.append(("healthy", timeline, {}, []))

    # A dead letter (an invalid envelope routed to partition 0) and a quarantined outbox row.
    bad = {**new_event(article_id="a1"), "eventId": "not-a-uuid"}
    s.ns.publish([orjson.dumps(bad)], routing_key="material.published")
    conn = outbox.connect(s.producer)
    try:
        with outbox.transaction(conn):
            outbox.enqueue(conn, new_event(article_id="q1"), routing_key="nobody.listens")
    finally:
        conn.close()
    problems = s.settle("the dead letter seen by both runs and the broker, the row quarantined", lambda x: (
        x.values("delivery_queue_ready", kind="dead") == [1, 1]
        and x.value("rabbitmq_detailed_queue_messages_ready", queue=DEAD) == 1
        and x.value("outbox_rows", state="quarantined") == 1))
    seen.append(problems)
    timeline = Timeline()
    timeline.add(problems, 10)
    quarantined = alert("OutboxQuarantined", job=d.job, instance=d.instance, state="quarantined")
    dead_letters = alert("DeliveryDeadLetters", queue=DEAD)
    main_ready = problems.value("rabbitmq_detailed_queue_messages_ready", queue=MAIN)
    dead_ready = problems.value("rabbitmq_detailed_queue_messages_ready", queue=DEAD)
    # A passive declare counts the single active consumer (the standby is not attached at all).
    [attached_now] = set(problems.values("delivery_queue_consumers", kind="main"))
    exprs = panel_exprs()
    [dead_panel] = [e for e in exprs if e.startswith("sum by (consumer)") and 'kind="dead"' in e]
    [backlog_panel] = [e for e in exprs if e.startswith("sum by (consumer)") and 'kind="main"' in e]
    [depths] = [e for e in exprs if "delivery_queue_ready{consumer" in e]
    [attached] = [e for e in exprs if "delivery_queue_consumers" in e]
    # The broker's figures, once per queue: the active run and the standby both export them.
    panels = [
        (dead_panel, [{"labels": '{consumer="catalog"}', "value": dead_ready}]),
        (backlog_panel, [{"labels": '{consumer="catalog"}', "value": main_ready}]),
        (depths, [{"labels": f'{{consumer="catalog",queue="{MAIN}"}}', "value": main_ready},
                  {"labels": f'{{consumer="catalog",queue="{DEAD}"}}', "value": dead_ready}]),
        (attached, [{"labels": f'{{consumer="catalog",queue="{MAIN}"}}', "value": attached_now}]),
    ]
    scenarios.append(("a dead letter and a quarantined row", timeline, expect(quarantined, dead_letters), panels))

    # The broker down: the active run loses it (the standby had none), both runs' queue checks
    # fail, a new row waits in the outbox. Only the active run's alerts fire.
    s.broker.stop_app()
    s.produce("a4")
    down = s.settle("the active run disconnected, the new row pending", lambda x: (
        x.value("delivery_connected", instance=a.instance) == 0
        and x.value("delivery_connected", instance=sb.instance) == 0
        and x.values("delivery_queue_up") == [0, 0]
        and x.value("delivery_active", instance=sb.instance) == 0
        and (x.value("outbox_rows", state="due") or 0) >= 1))
    seen.append(down)
    timeline = Timeline()
    timeline.add(down, 20)
    firing = [alert(name, **s.labels("active")) for name in ("DeliveryDisconnected", "DeliveryBrokerNotAnswering")]
    if down.values(PENDING_AGE):
        firing.append(alert("OutboxPendingTooOld", job=d.job, instance=d.instance))
    scenarios.append(("the broker down", timeline, expect(quarantined, *firing), []))
    s.broker.start_app()
    # The active run still holds the database: it attaches again and applies a4; the standby waits on.
    s.settle("the broker back: the active run attached again, the row published and applied by it", lambda x: (
        x.value("delivery_connected", instance=a.instance) == 1
        and x.value("delivery_connected", instance=sb.instance) == 0
        and x.value("delivery_active", instance=a.instance) == 1
        and x.value("delivery_active", instance=sb.instance) == 0
        and x.value("outbox_rows", state="due") == 0 and x.value("outbox_rows", state="published") == 4
        and x.value("delivery_events_total", outcome="updated", instance=a.instance) == 4
        and x.value("rabbitmq_detailed_queue_consumers", queue=MAIN) == 1))
    assert "taking over" not in standby.output()[1], standby.output()[1][-3000:]

    # A queue the broker cannot serve while it answers for the others: the dead queue held by
    # another connection (its passive declare refused, as a queue whose home node is down is).
    holder = pika.BlockingConnection(pika.URLParameters(s.broker.url))
    try:
        held = holder.channel()
        held.queue_delete(DEAD)  # its dead letter goes with it: put back below
        held.queue_declare(DEAD, exclusive=True)
        unreadable = s.settle("both runs: the dead queue unreadable, the main one readable", lambda x: (
            x.values("delivery_queue_readable", kind="dead") == [0, 0]
            and x.values("delivery_queue_readable", kind="main") == [1, 1]
            and x.values("delivery_queue_up") == [1, 1]))
    finally:
        holder.close()
    seen.append(unreadable)
    timeline = Timeline()
    timeline.add(unreadable, 5)
    scenarios.append(("a queue that cannot be read", timeline, expect(quarantined, alert(
        "DeliveryQueueUnreadable", consumer="catalog", partition="0", queue=DEAD, kind="dead")), []))
    s.cluster.declare()
    s.ns.publish([orjson.dumps(bad)], routing_key="material.published")  # the dead letter again, for what follows
    # ... and the rejection committed by the active run before the database is locked below.
    s.settle("the dead queue readable again, its dead letter back, the rejection committed", lambda x: (
        x.values("delivery_queue_readable", kind="dead") == [1, 1]
        and x.values("delivery_queue_ready", kind="dead") == [1, 1]
        and sum(x.values("delivery_rejections_total", instance=a.instance)) == 2))

    # The database locked: the active run cannot commit while the backlog grows past 10000.
    lock = sqlite3.connect(s.cluster.db(0), isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        sent = 10_050
        s.ns.publish([orjson.dumps(new_event(article_id=f"g{i}")) for i in range(sent)])
        timeline = Timeline()
        for step in range(21):
            if step:
                s.ns.publish([orjson.dumps(new_event(article_id=f"g{sent + i}")) for i in range(20)])
                sent += 20
            # The active run holds one delivery (prefetch 1): the rest is ready.
            stuck = s.settle(f"{sent - 1} ready, the store unhealthy", lambda x, n=sent - 1: (
                x.values("delivery_queue_ready", kind="main") == [n, n]
                and x.value("delivery_store_healthy", instance=a.instance) == 0))
            timeline.add(stuck)
        seen.append(stuck)
        scenarios.append(("no commit while the backlog grows", timeline, expect(
            quarantined, dead_letters,
            alert("DeliveryNoCommit", consumer="catalog", partition="0"),
            # the active run is listed on the queue and commits nothing: no progress
            alert("DeliveryBacklogNotDraining", queue=MAIN),
            alert("DeliveryStoreUnhealthy", **s.labels("active")),
            alert("DeliveryBacklogGrowing", consumer="catalog", partition="0", queue=MAIN)), []))

        # Every process killed (kill -9 of the main PID): the broker still tells the backlog.
        # The standby first: it would take the partition over from a dead active run.
        kill(standby, main_only=True)
        kill(active, main_only=True)
        os.kill(dispatch.pid, signal.SIGKILL)
        dispatch.communicate()
    finally:
        lock.close()
    dead = s.settle("the broker: a backlog and no consumer", lambda x: (
        x.value("rabbitmq_detailed_queue_consumers", queue=MAIN) == 0
        and (x.value("rabbitmq_detailed_queue_messages_ready", queue=MAIN) or 0) > 0))
    seen.append(dead)
    timeline = Timeline()
    timeline.add(dead, 10)
    backlog = alert("DeliveryBacklogWithoutConsumer", queue=MAIN)
    scenarios.append(("every process killed", timeline, expect(
        dead_letters, backlog, alert("OutboxDispatcherDown", job=d.job, instance=d.instance),
        *[alert("DeliveryConsumerDown", job=t.job, instance=t.instance) for t in (a, sb)]), []))

    # No target left to scrape (gone from service discovery): absent().
    gone = s.settle("the broker alone", lambda x: True, targets=[s.rabbitmq])
    timeline = Timeline()
    timeline.add(gone, 10)
    scenarios.append(("no target left", timeline, expect(
        dead_letters, backlog, alert("OutboxDispatcherDown", job="delivery-dispatch"),
        alert("DeliveryConsumerDown", job="delivery-consumer")), []))

    # Ghost consumers: every run gone, and a consumer the broker lists (one that never acks, as a
    # channel on a lost node): not "without consumer", but not draining.
    ghost_conn = pika.BlockingConnection(pika.URLParameters(s.broker.url))
    try:
        ghost_channel = ghost_conn.channel()
        ghost_channel.basic_qos(prefetch_count=1)
        ghost_channel.basic_consume(MAIN, lambda *args: None)
        ghost = s.settle("a consumer that never acks listed on the backlog", lambda x: (
            x.value("rabbitmq_detailed_queue_consumers", queue=MAIN) == 1
            and (x.value("rabbitmq_detailed_queue_messages_ready", queue=MAIN) or 0) > 0), targets=[s.rabbitmq])
    finally:
        ghost_conn.close()
    seen.append(ghost)
    timeline = Timeline()
    timeline.add(ghost, 10)
    scenarios.append(("ghost consumers", timeline, expect(
        dead_letters, alert("DeliveryBacklogNotDraining", queue=MAIN),
        alert("OutboxDispatcherDown", job="delivery-dispatch"), alert("DeliveryConsumerDown", job="delivery-consumer")),
        []))

    # Every metric the rules and panels name was in a real scrape.
    named = metric_names([rule["expr"] for rule in rules()] + exprs)
    recorded = {name for x in seen for name in x.declared}
    wanted = {name for name in named if re.match(r"(delivery|outbox|rabbitmq|process)_", name)}
    missing = wanted - recorded - ({PENDING_AGE} if not any(x.values(PENDING_AGE) for x in seen) else set())
    assert not missing, f"named in deploy/ but in no scrape: {sorted(missing)}"

    # promtool compares annotations too: the test's copy of the rules has none (check rules reads the real ones).
    bare = yaml.safe_load(RULES.read_text())
    for group in bare["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(bare, sort_keys=False))
    alerts = {rule["alert"] for rule in rules()}
    tests = [{"name": name, **promtool_test(timeline, named, alerts, firing, exprs)}
             for name, timeline, firing, exprs in scenarios]
    unit = tmp_path / "alerts.test.yml"
    unit.write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests},
                                   sort_keys=False, width=1_000_000))
    done = subprocess.run(["promtool", "test", "rules", str(unit)], capture_output=True, text=True, timeout=300)
    assert 0 == done.returncode, done.stdout[-8000:] + done.stderr[-8000:]
