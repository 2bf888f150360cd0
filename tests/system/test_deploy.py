"""deploy/: the Prometheus rules and the Grafana dashboard name only metrics that
a real ``run --metrics-port`` exports; every systemd unit verifies, is hardened
(systemd-analyze security) and runs as the user and in the directory that
deploy/'s sysusers.d and tmpfiles.d files create. (The alerts themselves are
evaluated on real scrapes in test_alerts.py.)"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from brokerkit import Namespace, RunProcess
from deploykit import deploy_env, write_deployment
from partitionkit import Cluster
from support import REPO, count_rows, new_event, wait_until
from webhook_server import free_port

from delivery_consumer.amqp.partitions import partition_of

DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "delivery-consumer.rules.yml"
DASHBOARD = DEPLOY / "grafana" / "delivery-consumer.json"
UNIT = DEPLOY / "systemd" / "delivery-consumer@.service"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
SYSUSERS = DEPLOY / "sysusers.d" / "delivery-consumer.conf"
TMPFILES = DEPLOY / "tmpfiles.d" / "delivery-consumer.conf"
INSTALLED = "/opt/delivery-consumer/.venv/bin/delivery-consumer"
METRIC = re.compile(r"\b((?:delivery|process)_[a-z_]+)\b")


def rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(RULES.read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in board["panels"] for target in panel["targets"]]


def named_metrics() -> set[str]:
    exprs = [rule["expr"] for rule in rules()] + dashboard_exprs()
    return {name for expr in exprs for name in METRIC.findall(expr)}


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text: str = answer.read().decode()
        return text


def samples(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of *name*'s samples in an exposition text."""
    found = re.findall(rf"^{name}\{{([^}}]*)\}} ", text, re.M)
    return [dict(re.findall(r'(\w+)="([^"]*)"', labels)) for labels in found]


def exported(text: str) -> set[str]:
    """Sample names, and the families declared by # TYPE (a labelled counter not yet
    incremented has no sample), with the suffixes their samples would carry."""
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            names.add(family)
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(kind, [])
            names.update(family + suffix for suffix in suffixes)
    return names


@pytest.mark.broker
def test_every_metric_the_rules_and_dashboard_name_is_in_a_real_scrape(ns: Namespace) -> None:
    """run --metrics-port consumes a good and a bad event; its /metrics holds every name used in deploy/."""
    port = free_port()
    ns.publish([orjson.dumps(new_event()), b"{not json"], routing_key="material.published", declare=["catalog"])
    proc = ns.start_run("catalog", "--metrics-port", str(port))
    def both_counted() -> str | None:
        text = scrape(port)
        return text if 'outcome="updated"' in text and "delivery_dead_letters_total{" in text else None

    try:
        text = wait_until("the good and the bad event on /metrics", both_counted, procs=[proc], ignoring=(OSError,))
        assert re.search(r'delivery_queue_ready\{consumer="catalog",kind="dead",queue="[^"]+"\} 1\.0', text), text
        assert not any("partition" in labels for labels in samples(text, "delivery_queue_up")), text
        missing = named_metrics() - exported(text)
        assert not missing, f"named in deploy/ but not exported by run: {sorted(missing)}"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
    assert 0 == proc.returncode


@pytest.mark.broker
def test_a_partition_runs_queue_metrics_carry_its_partition_label(ns: Namespace) -> None:
    """run --partition K: the queue depths carry partition="K" as its commit time does, so that
    DeliveryNoCommit (on consumer, partition) pairs partition K's commits with K's queue only."""
    cluster = Cluster(ns, "catalog", 2)
    cluster.declare()
    port = free_port()
    try:
        event = new_event(article_id="metrics-a")
        k = partition_of(event["articleId"], 2)
        cluster.start(k, "--metrics-port", str(port))
        cluster.publish([event])
        def applied() -> str | None:
            text = scrape(port)
            return text if 'outcome="updated"' in text else None

        text = wait_until(f"partition {k}'s event on /metrics", applied, procs=cluster.procs, ignoring=(OSError,))
        queue = f"{ns.prefix}.catalog.p{k}"
        expected = {"consumer": "catalog", "partition": str(k)}
        assert [expected] == samples(text, "delivery_last_commit_timestamp_seconds"), text
        assert [expected] == samples(text, "delivery_queue_up"), text
        for name in ("delivery_queue_ready", "delivery_queue_consumers", "delivery_queue_readable"):
            assert [{**expected, "kind": "main", "queue": queue}, {**expected, "kind": "dead", "queue": queue + ".dead"}
                    ] == sorted(samples(text, name), key=lambda labels: labels["queue"]), text
    finally:
        cluster.stop()
        cluster.delete()
    assert all(0 == proc.returncode for proc in cluster.procs)


def test_the_alert_rules_are_well_formed() -> None:
    """Every rule has an alert name, an expression, a duration, a severity and a summary;
    promtool agrees when it is installed."""
    found = rules()
    assert {"DeliveryDeadLetters", "DeliveryBacklogWithoutConsumer", "DeliveryBacklogNotDraining",
            "DeliveryQueueUnreadable", "DeliveryNoCommit",
            "DeliveryStoreUnhealthy", "DeliveryConsumerDown", "OutboxQuarantined", "OutboxPendingTooOld",
            "OutboxDispatcherDown"} <= {rule["alert"] for rule in found}
    for rule in found:
        assert rule["expr"] and rule["for"] and rule["labels"]["severity"] and rule["annotations"]["summary"], rule
        # A join of two series pairs one partition's with the same partition's (a queue is one partition's,
        # a scrape target one run's).
        for on in re.findall(r"\bon \(([^)]*)\)", rule["expr"]):
            assert {"partition", "queue", "instance"} & {label.strip() for label in on.split(",")}, rule
    promtool = shutil.which("promtool")
    if promtool:
        done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
        assert 0 == done.returncode, done.stdout + done.stderr


#: The one way a rule or a panel may read a commit time: the newest over every run of a
#: (consumer, partition). A standby run (single active consumer) never commits and exports 0.
NEWEST_COMMIT = re.compile(r"(\bmax by \(consumer, partition\) \()?delivery_last_commit_timestamp_seconds\b")


def test_a_commit_time_is_the_newest_of_every_run_of_its_partition() -> None:
    """Every rule and panel that reads the last-commit time takes its max by (consumer, partition):
    the standby run of a partition, which exports 0, neither pages nor shows as the partition's."""
    exprs = [rule["expr"] for rule in rules()] + dashboard_exprs()
    reading = [expr for expr in exprs if NEWEST_COMMIT.search(expr)]
    assert any("DeliveryNoCommit" == rule["alert"] and rule["expr"] in reading for rule in rules())
    assert len(reading) >= 2  # the alert and the "Since last commit" panel
    for expr in reading:
        assert all(NEWEST_COMMIT.findall(expr)), expr


def test_the_dashboard_is_grafana_json_with_templated_queries() -> None:
    """Valid JSON, unique panel ids, every query filtered by the consumer variable or job."""
    board = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for expr in dashboard_exprs():
        assert "$consumer" in expr or "$job" in expr, expr


def _exec_start(text: str, instance: str, program: str) -> list[str]:
    """The unit's ExecStart as systemd runs it for *instance*: specifiers and ``$$`` resolved,
    split as systemd splits it (its quoting is the shell's), *program* instead of the installed one."""
    [line] = re.findall(r"^ExecStart=(.*)$", text, re.M)
    line = line.replace("/opt/delivery-consumer/.venv/bin/delivery-consumer", program)
    line = re.sub(r"%(.)", lambda m: {"%": "%", "i": instance}[m.group(1)], line).replace("$$", "$")
    return shlex.split(line)


@pytest.mark.parametrize(("instance", "args"), [
    ("audit", "run --consumer audit --log-format json"),
    ("catalog.p12", "run --consumer catalog --partition 12 --log-format json"),
    ("my.plugin", "run --consumer my.plugin --log-format json"),
])
def test_the_systemd_instance_is_a_consumer_or_one_partition_of_one(instance: str, args: str) -> None:
    """The instance name becomes run's options: NAME, or NAME.pK for partition K."""
    done = subprocess.run(_exec_start(UNIT.read_text(), instance, "/bin/echo"), capture_output=True, text=True,
                          timeout=30)
    assert (0, args) == (done.returncode, done.stdout.strip()), done.stderr


def systemd_analyze() -> str:
    """systemd-analyze's path; skipped without it (failed under CI, which installs it)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        why = "systemd-analyze is not installed (apt-get install systemd; .ci/run does it)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why + ": the units were only read, not verified")
    return analyze


def installed(unit: Path, directory: Path) -> Path:
    """*unit* as installed in *directory*, this venv's script instead of /opt's; a template
    as its instance ``catalog``."""
    script = Path(sys.executable).parent / "delivery-consumer"
    copy = directory / unit.name
    copy.write_text(unit.read_text().replace(INSTALLED, str(script)))
    if not unit.name.endswith("@.service"):
        return copy
    instance = directory / unit.name.replace("@.", "@catalog.")
    instance.symlink_to(copy.name)
    return instance


def test_the_systemd_unit_template_kills_the_whole_group_and_verifies(tmp_path: Path) -> None:
    """KillMode=control-group, run is exec'd (the main process); systemd-analyze verify finds nothing
    wrong with an instance of a consumer or of a partition."""
    text = UNIT.read_text()
    assert re.search(r"^KillMode=control-group$", text, re.M)
    assert f"exec {INSTALLED} run " in text
    analyze = systemd_analyze()
    installed(UNIT, tmp_path)
    (tmp_path / "delivery-consumer@catalog.p1.service").symlink_to(UNIT.name)
    for instance in ("catalog", "catalog.p1"):
        done = subprocess.run([analyze, "verify", str(tmp_path / f"delivery-consumer@{instance}.service")],
                              capture_output=True, text=True, timeout=60)
        ours = [line for line in done.stderr.splitlines() if "delivery-consumer@" in line]
        assert 0 == done.returncode and not ours, done.stderr


@pytest.mark.parametrize("unit", UNITS, ids=lambda unit: unit.name)
def test_every_unit_verifies_and_its_exposure_is_2_or_lower(unit: Path, tmp_path: Path) -> None:
    """systemd-analyze verify finds nothing wrong with the unit, and ``security --offline``
    rates its exposure 2.0 or lower (the hardening is in the file, not assumed)."""
    analyze = systemd_analyze()
    path = installed(unit, tmp_path)
    done = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
    ours = [line for line in done.stderr.splitlines() if unit.name.split("@")[0].split(".")[0] in line]
    assert 0 == done.returncode and not ours, done.stderr
    done = subprocess.run([analyze, "security", "--offline=true", "--threshold=20", "--no-pager", str(path)],
                          capture_output=True, text=True, timeout=60)
    [level] = re.findall(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert 0 == done.returncode and float(level) <= 2.0, done.stdout + done.stderr


def _sandbox(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Sandbox"))
    end = next(i for i, line in enumerate(lines) if line.startswith("SystemCallErrorNumber="))
    return lines[start:end + 1]


def test_every_unit_runs_as_the_sysusers_user_in_its_private_state_directory() -> None:
    """Every unit: the user sysusers.d creates, the state directory tmpfiles.d creates (0700) as its
    only writable path, UMask=0077 and the same sandbox; a crash restarts, exit 2 (a person must
    look) does not."""
    [user] = re.findall(r"^u\s+(\S+)\s", SYSUSERS.read_text(), re.M)
    dirs = dict(re.findall(r"^d\s+(\S+)\s+(\d+)", TMPFILES.read_text(), re.M))
    assert "0700" == dirs["/var/lib/delivery-consumer"]
    sandboxes = []
    for unit in UNITS:
        text = unit.read_text()
        settings = dict(re.findall(r"^(\w+)=(.*)$", text, re.M))
        assert user == settings["User"] == settings["Group"], unit.name
        assert ("delivery-consumer", "0700") == (settings["StateDirectory"], settings["StateDirectoryMode"]), unit
        assert "/var/lib/delivery-consumer" == settings["ReadWritePaths"] == settings["WorkingDirectory"], unit
        assert ("0077", "strict", "on-failure", "2") == (settings["UMask"], settings["ProtectSystem"],
                                                        settings["Restart"], settings["RestartPreventExitStatus"])
        sandboxes.append(_sandbox(text))
    assert all(sandbox == sandboxes[0] for sandbox in sandboxes)


def test_sysusers_and_tmpfiles_create_the_user_and_the_state_directory(tmp_path: Path) -> None:
    """systemd-sysusers and systemd-tmpfiles, run on an empty root with deploy/'s files installed
    where a package puts them, create the user (no login shell) and a state directory only it can
    open, and a configuration directory it can read and not write."""
    sysusers, tmpfiles = shutil.which("systemd-sysusers"), shutil.which("systemd-tmpfiles")
    if sysusers is None or tmpfiles is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-sysusers/systemd-tmpfiles are not installed (package systemd)")
        pytest.skip("systemd-sysusers/systemd-tmpfiles are not installed (apt-get install systemd)")
    root = tmp_path / "root"
    for source, where in ((SYSUSERS, "usr/lib/sysusers.d"), (TMPFILES, "usr/lib/tmpfiles.d")):
        (root / where).mkdir(parents=True)
        shutil.copy(source, root / where / source.name)
    (root / "etc").mkdir()
    for tool in (sysusers, tmpfiles):
        done = subprocess.run([tool, f"--root={root}", *(["--create"] if tool == tmpfiles else [])],
                              capture_output=True, text=True, timeout=60)
        assert 0 == done.returncode and "delivery-consumer.conf" not in done.stderr, done.stderr
    [entry] = [line.split(":") for line in (root / "etc/passwd").read_text().splitlines()
               if line.startswith("delivery-consumer:")]
    uid, gid, home, shell = int(entry[2]), int(entry[3]), entry[5], entry[6]
    assert ("/var/lib/delivery-consumer", "/usr/sbin/nologin") == (home, shell)
    state, etc = (root / "var/lib/delivery-consumer").stat(), (root / "etc/delivery-consumer").stat()
    assert (0o700, uid, gid) == (state.st_mode & 0o7777, state.st_uid, state.st_gid)
    assert (0o750, 0, gid) == (etc.st_mode & 0o7777, etc.st_uid, etc.st_gid)


#: Runs a command with PR_SET_MDWE (what MemoryDenyWriteExecute= enforces): memory can never be
#: writable and executable; the rule passes to the command's children (run's worker) through exec.
MDWE = """
import ctypes, mmap, os, sys
if ctypes.CDLL(None, use_errno=True).prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
    sys.exit(f"PR_SET_MDWE: {os.strerror(ctypes.get_errno())}")
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    sys.exit("PR_SET_MDWE set, yet a writable and executable mapping was allowed")
except PermissionError:
    pass
os.execv(sys.argv[1], sys.argv[1:])
"""


@pytest.mark.broker
def test_dispatch_run_and_console_work_with_memory_deny_write_execute(ns: Namespace) -> None:
    """Under PR_SET_MDWE (MemoryDenyWriteExecute=yes in the units), dispatch publishes the outbox,
    run applies it and the console shows it: nothing in them needs writable executable memory."""
    probe = subprocess.run([sys.executable, "-c", MDWE, "/bin/true"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"this kernel cannot enforce it: {probe.stderr.strip()}")
    producer = ns.workdir / "producer.db"
    for article in ("m1", "m2"):
        done = ns.cli("produce", "--db", str(producer), "--article", article, "--title", article,
                      "--url", f"https://example.org/{article}")
        assert 0 == done.returncode, done.stderr
    script = str(Path(sys.executable).parent / "delivery-consumer")
    done = subprocess.run([sys.executable, "-c", MDWE, script, "dispatch", "--db", str(producer), "--consumer",
                           "catalog", "--exit-when-idle", "1s"], cwd=ns.workdir, env=ns.env(),
                          capture_output=True, text=True, timeout=120)
    assert 0 == done.returncode, done.stderr
    proc = RunProcess([sys.executable, "-c", MDWE, script, "run", "--consumer", "catalog", "--db",
                       str(ns.db("catalog")), "--exit-when-idle", "1.5"], cwd=ns.workdir, env=ns.env())
    ns.started.append(proc)
    result = proc.until_idle(120)
    assert 0 == result.returncode, result.stderr
    assert 2 == count_rows(ns.db("catalog"), "inbox"), result.stderr
    config = write_deployment(ns.workdir, ns=ns, consumers=("catalog",))
    config.write_text(config.read_text().replace('"state/catalog/inbox.db"', f'"{ns.db("catalog")}"')
                      .replace('"producer.db"', f'"{producer}"'))
    console = RunProcess([sys.executable, "-c", MDWE, script, "console", "--port", "0"], cwd=ns.workdir,
                         env=deploy_env(config))
    ns.started.append(console)
    found = wait_until("the console's URL", lambda: re.search(r"console on (http://\S+/)", console.output()[1]),
                       procs=[console])
    with urllib.request.urlopen(found.group(1), timeout=30) as page:
        assert 200 == page.status and "catalog" in page.read().decode()
    os.kill(console.pid, signal.SIGTERM)
    console.communicate(timeout=30)
    assert 0 == console.returncode, console.output()[1]
