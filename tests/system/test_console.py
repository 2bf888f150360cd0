"""The console in a real headless browser (Debian's chromium driven by
Playwright, nothing downloaded): the page loads with the deployment's state,
a trace is found by eventId and by articleId, a dead letter is requeued
through the confirmation step when actions are allowed, and refused when
they are not.
Screenshots go to the test's tmp_path (pytest's output directory)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from brokerkit import Namespace, RunProcess
from deploykit import dc, deploy_env, run_until_idle, write_deployment
from support import wait_until
from webhook_server import WebhookServer

pytestmark = pytest.mark.broker

CHROMIUM = Path("/usr/bin/chromium")


def _need_browser() -> Any:
    """Playwright's sync API, or a skip (a failure under CI, which installs both)."""
    why = None
    try:
        from playwright import sync_api
    except ImportError:
        why = "the playwright package is not installed (pip install '.[test]')"
    if why is None and not CHROMIUM.exists():
        why = f"{CHROMIUM} is missing (apt-get install chromium; .ci/run does it)"
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return sync_api


class ConsoleProcess:
    """``delivery-consumer console --port 0`` as a real process; its URL from its first line."""

    def __init__(self, config: Path, *args: str) -> None:
        self.proc = RunProcess([sys.executable, "-m", "delivery_consumer", "console", "--port", "0", *args],
                               cwd=config.parent, env=deploy_env(config))
        try:
            found = wait_until("the console's URL on stderr",
                               lambda: re.search(r"console on (http://\S+/)", self.proc.output()[1]), procs=[self.proc])
        except AssertionError:
            self.stop()
            raise
        self.url = found.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.communicate()


@pytest.fixture
def browser() -> Iterator[Any]:
    """A headless chromium page, closed at teardown."""
    sync_api = _need_browser()
    with sync_api.sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield launched.new_page()
        finally:
            launched.close()


@pytest.fixture(params=["sqlite"])
def deployment(request: pytest.FixtureRequest, ns: Namespace, tmp_path: Path) -> Iterator[tuple[Path, str, str]]:
    """catalog and webhook fed through the outbox; the eventIds of an applied event and
    of one dead-lettered endpoint-rejected (the endpoint is healed afterwards). With the
    parameter ``postgres``, webhook's inbox (and its fence) is in a PostgreSQL database of its own."""
    with WebhookServer() as server:
        config = write_deployment(tmp_path, ns=ns, webhook_url=server.url, consumers=("catalog", "webhook"))
        if request.param == "postgres":
            url = request.getfixturevalue("pg_url")
            text = config.read_text("utf-8")
            assert '"state/webhook/inbox.db"' in text
            config.write_text(text.replace('"state/webhook/inbox.db"', f'"{url}"'), "utf-8")
        ids = []
        for article, title in (("a-1", "Fine"), ("a-2", "reject")):
            done = dc(config, "produce", "--article", article, "--title", title, "--url", "https://x/y", "--json")
            ids.append(orjson.loads(done.stdout)["eventId"])
        assert 0 == dc(config, "dispatch", "--exit-when-idle", "1s", "-c", "catalog", "-c", "webhook").returncode
        for consumer in ("catalog", "webhook"):
            assert 0 == run_until_idle(config, consumer).returncode
        server.healed = True
        yield config, ids[0], ids[1]


@pytest.fixture
def start_console() -> Iterator[Any]:
    started: list[ConsoleProcess] = []

    def start(config: Path, *args: str) -> ConsoleProcess:
        started.append(ConsoleProcess(config, *args))
        return started[-1]

    yield start
    for console in started:
        console.stop()


@pytest.mark.parametrize("deployment", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
                         indirect=True)
def test_the_page_traces_and_requeues_with_actions_allowed(
        deployment: tuple[Path, str, str], browser: Any, start_console: Any, ns: Namespace, tmp_path: Path) -> None:
    """Status with the dead letter grouped by code, a trace by eventId, then requeue through
    the confirmation step: the dead queue is empty and the consumer applies the event, which
    the trace by articleId then lists as applied by both consumers -- with webhook's inbox in a
    SQLite file and in PostgreSQL."""
    config, fine, refused = deployment
    shots = tmp_path / "screenshots"
    console = start_console(config, "--allow-actions")
    page = browser
    page.goto(console.url)
    assert "needs a person" in page.inner_text("#verdict")
    dead = page.inner_text("#dead")
    assert "endpoint-rejected" in dead and refused in dead and "400" in dead
    page.screenshot(path=str(shots / "1-status.png"), full_page=True)

    page.fill("#q", fine)
    page.click("#search")
    verdicts = page.inner_text("#verdicts")
    assert re.search(r"catalog\s+applied updated", verdicts) and re.search(r"webhook\s+applied notified", verdicts)
    page.fill("#q", refused)
    page.click("#search")
    assert "dead-lettered endpoint-rejected" in page.inner_text("#verdicts")
    page.screenshot(path=str(shots / "2-trace.png"), full_page=True)

    page.click("a.action:text('requeue')")
    assert refused in page.inner_text("main")
    page.screenshot(path=str(shots / "3-confirm.png"), full_page=True)
    page.click("#confirm")
    assert "1 requeued" in page.inner_text("#result")
    page.screenshot(path=str(shots / "4-done.png"), full_page=True)
    assert 0 == ns.count(f"{ns.prefix}.webhook.dead")

    assert 0 == run_until_idle(config, "webhook").returncode
    page.goto(console.url)
    assert "healthy" == page.inner_text("#verdict")

    page.fill("#q", "a-2")
    page.click("#search")
    assert "articleId a-2" == page.inner_text("main h1")
    row = page.locator("main tr", has_text=refused)
    assert 1 == row.count() and re.search(r"updated\s+notified", row.inner_text()), page.inner_text("main")
    assert fine not in page.inner_text("main")  # a-1's event is not a-2's
    page.screenshot(path=str(shots / "5-article.png"), full_page=True)

    forged = page.request.post(console.url + "dead/purge", form={"consumer": "webhook", "code": "x"})
    assert 403 == forged.status and "CSRF" in forged.text()


def test_without_actions_the_console_is_read_only(
        deployment: tuple[Path, str, str], browser: Any, start_console: Any, ns: Namespace, tmp_path: Path) -> None:
    """No action links, the confirmation page and every POST refused (403), the dead letter stays."""
    config, _fine, refused = deployment
    console = start_console(config)
    page = browser
    page.goto(console.url)
    assert "read-only" in page.inner_text("header")
    assert 0 == page.locator("a.action").count()
    answer = page.goto(console.url + f"dead/confirm?consumer=webhook&action=requeue&event={refused}")
    assert 403 == answer.status and "read-only" in page.inner_text("#refused")
    posted = page.request.post(console.url + "dead/requeue", form={"consumer": "webhook", "event": refused})
    assert 403 == posted.status and "--allow-actions" in posted.text()
    page.screenshot(path=str(tmp_path / "screenshots" / "read-only.png"), full_page=True)
    assert 1 == ns.count(f"{ns.prefix}.webhook.dead")


# -- under load ---------------------------------------------------------------------------


def _get(url: str, timeout: float = 120) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read().decode("utf-8")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8")


def test_two_hundred_concurrent_pages_are_answered_and_dead_list_is_not_locked_out(
        deployment: tuple[Path, str, str], start_console: Any) -> None:
    """200 concurrent GET / from real clients are all answered with the dead letters read (never "in
    use by another reader"), `dead list` run meanwhile succeeds, and an uppercase eventId is traced."""
    import threading

    config, _fine, refused = deployment
    console = start_console(config)
    answers: list[tuple[int, str]] = []
    lock = threading.Lock()
    start = threading.Barrier(200)

    def fetch() -> None:
        start.wait()
        answer = _get(console.url)
        with lock:
            answers.append(answer)

    clients = [threading.Thread(target=fetch) for _ in range(200)]
    for client in clients:
        client.start()
    wait_until("a first page", lambda: answers, timeout=120)
    listed = dc(config, "dead", "list", "--consumer", "webhook")  # while the console is hammered
    for client in clients:
        client.join(timeout=300)
    assert 0 == listed.returncode and refused in listed.stdout, listed.stderr
    assert 200 == len(answers)
    assert [200] * 200 == [status for status, _ in answers]
    assert all("endpoint-rejected" in page and "in use by another reader" not in page for _, page in answers)

    status, page = _get(console.url + f"trace?q={refused.upper()}")
    assert 200 == status and "dead-lettered endpoint-rejected" in page


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no thread count")


def test_slow_clients_are_dropped_and_never_grow_the_threads(
        ns: Namespace, tmp_path: Path, start_console: Any) -> None:
    """Forty clients that never finish their request head, and one that sends it a byte at a time,
    are closed by the console (a deadline for the whole request, not per read); meanwhile it keeps
    a bounded number of threads and still answers."""
    import socket
    import threading
    import urllib.parse

    most = 8 + 4  # the pool's eight workers, the main thread and a few of the process's own
    console = start_console(write_deployment(tmp_path, ns=ns, consumers=("catalog",)))
    where = urllib.parse.urlsplit(console.url)
    address = (where.hostname or "127.0.0.1", where.port or 80)
    slow = []
    for _ in range(40):
        sock = socket.create_connection(address, timeout=120)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: ")
        slow.append(sock)
    closed = threading.Event()

    def trickle() -> None:
        with socket.create_connection(address, timeout=120) as sock:
            try:
                for byte in b"GET / HTTP/1.1\r\n" + b"X-Slow: " + b"x" * 10_000:
                    sock.sendall(bytes([byte]))
                    if closed.wait(0.5):
                        return
            except OSError:  # the console closed it: what must happen
                closed.set()

    trickler = threading.Thread(target=trickle)
    trickler.start()
    try:
        assert 200 == _get(console.url + "healthz")[0]
        assert _threads(console.proc.pid) <= most
        for sock in slow:
            assert b"" == sock.recv(1024)  # closed by the console, without an answer
        assert closed.wait(120), "the client sending a byte at a time was never dropped"
        assert _threads(console.proc.pid) <= most
        status, page = _get(console.url)
        assert 200 == status and "Status" in page
    finally:
        closed.set()
        trickler.join()
        for sock in slow:
            sock.close()


def test_the_page_shows_a_queue_that_cannot_be_read(
        ns: Namespace, tmp_path: Path, browser: Any, start_console: Any) -> None:
    """The dead queue held by another connection (its passive declare refused, as for a queue whose
    node is down): the page says "needs a person", names the queue, and its row shows UNREADABLE
    (not "-" and healthy); once the queue answers again, the page is healthy with the row "ok"."""
    config = write_deployment(tmp_path, ns=ns, consumers=("catalog",))
    assert 0 == dc(config, "topology", "declare", "--consumer", "catalog").returncode
    dead = f"{ns.prefix}.catalog.dead"
    conn, ch = ns.channel()
    try:
        ch.queue_delete(dead)
        ch.queue_declare(dead, exclusive=True)
        console = start_console(config)
        page = browser
        page.goto(console.url)
        verdict = page.inner_text("#verdict")
        assert "needs a person" in verdict and f"queue {dead} cannot be read" in verdict, verdict
        row = page.locator("#consumers tr", has_text="catalog")
        assert "UNREADABLE" == row.locator(".queue-state").inner_text()
        assert "leaders and members online unknown" in page.inner_text("#management")
    finally:
        conn.close()
    assert 0 == dc(config, "topology", "declare", "--consumer", "catalog").returncode

    def healthy() -> bool:
        page.goto(console.url)  # the page is shared for a few seconds: ask until it is built again
        return "healthy" == page.inner_text("#verdict")

    wait_until("the page healthy again", healthy, timeout=60, interval=0.5)
    assert "ok" == page.locator("#consumers tr", has_text="catalog").locator(".queue-state").inner_text()


@pytest.mark.postgres
def test_the_page_shows_and_traces_a_consumer_whose_inbox_is_in_postgresql(
        ns: Namespace, tmp_path: Path, browser: Any, start_console: Any, pg_url: str) -> None:
    """catalog's ``db`` a postgresql:// URL with a password: the page shows its row, its outcomes per
    minute and its database without the password, and a trace by eventId and by articleId reads its
    receipts from its schema."""
    from support import new_event

    from delivery_consumer.consumers import catalog
    from delivery_consumer.inbox import apply_batch
    from delivery_consumer.inbox.pg import PgInboxDB
    from delivery_consumer.model.envelope import from_mapping

    events = [from_mapping(new_event(article_id=f"a-{i}", revision=1)) for i in range(3)]
    with PgInboxDB.open(pg_url, catalog.SPEC, create=True) as db:
        apply_batch(db, events)
    config = write_deployment(tmp_path, ns=ns, consumers=("catalog",))
    secret = pg_url.replace("postgres@", "postgres:s3cret@", 1)
    config.write_text(config.read_text("utf-8").replace('"state/catalog/inbox.db"', f'"{secret}"'), "utf-8")
    assert 0 == dc(config, "topology", "declare", "--consumer", "catalog").returncode
    console = start_console(config)
    page = browser
    page.goto(console.url)
    assert "healthy" == page.inner_text("#verdict"), page.inner_text("main")
    assert "s3cret" not in page.content()
    row = page.locator("#consumers tr", has_text="catalog").inner_text()
    assert re.search(r"catalog\s+0\s+-\s+0\s+0\s+3\s+3", row), row  # receipts of the last minute and hour
    assert "catalog (3 applied)" in page.inner_text("main")
    page.fill("#q", events[1].event_id)
    page.click("#search")
    assert re.search(r"catalog\s+applied updated", page.inner_text("#verdicts")), page.inner_text("main")
    assert "s3cret" not in page.content()
    page.fill("#q", "a-2")
    page.click("#search")
    assert "articleId a-2" == page.inner_text("main h1")
    assert 1 == page.locator("main tr", has_text=events[2].event_id).count(), page.inner_text("main")
    page.screenshot(path=str(tmp_path / "postgres-consumer.png"), full_page=True)
