"""The webhook consumer: tell an HTTP endpoint about every material event, once.

It POSTs ``{"articleId", "revision", "published", "title", "url"}`` to
``--webhook-url`` with ``Idempotency-Key: <articleId>:<revision>:notify``,
through the fence protocol of :mod:`delivery_consumer.inbox.fence`. How each
answer is classified, when a batch stops, and the timeouts: docs/fence.md,
"The webhook consumer".
"""

from __future__ import annotations

import email.utils
import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote, urlsplit

import orjson

from ..amqp.topology import DEFAULT_RETRY_DELAYS_MS
from ..inbox.fence import MIGRATIONS, Call, CallResult, apply_fenced
from ..model.contract import ConsumerSpec, ExternalBatchFn
from ..model.envelope import Envelope, canonical_bytes
from ..model.errors import ENDPOINT_REJECTED, ConfigError, Rejection, TransientError, safe_reason
from ..observability import tracing
from ..version import __version__

if TYPE_CHECKING:
    import httpx

    from ..inbox import ConsumerDB
    from ..model.contract import DeliveryMark, Outcome, WorkHooks

PUBLISHED: Final = "material.published"
STEP: Final = "notify"
RESULT: Final = "notified"
#: Largest wait the read timeout defaults to, whatever the retry delays (s).
MAX_DEFAULT_READ_TIMEOUT_S: Final = 10.0
MAX_CONNECT_TIMEOUT_S: Final = 2.0
#: Headers that may carry the provider's id when the body has no ``id``.
ID_HEADERS: Final = ("x-notification-id", "x-request-id", "location")
#: Characters left as they are in the Idempotency-Key header; anything else
#: (an articleId may be any Unicode text) is percent-encoded, so the header
#: is ASCII and still one-to-one with the fence key.
_KEY_SAFE: Final = ":@!$&'()*+,;=-._~"


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    """Where and how to call; read from ``run``'s options by :meth:`from_options`."""

    url: str
    idempotent: bool = True
    connect_timeout_s: float = 0.8
    read_timeout_s: float = 0.8

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> WebhookConfig:
        """Check the options of ``run``; ConfigError names the option at fault.

        Keys: ``webhook_url``, ``endpoint_idempotent``, ``connect_timeout_s``,
        ``read_timeout_s`` (None: the default) and ``first_retry_delay_ms``.
        """
        url = options.get("webhook_url")
        if not url:
            raise ConfigError("the webhook consumer needs --webhook-url (or DELIVERY_WEBHOOK_URL)")
        parts = urlsplit(str(url))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"--webhook-url {url!r}: give an http:// or https:// URL with a host")
        first_ms = int(options.get("first_retry_delay_ms") or DEFAULT_RETRY_DELAYS_MS[0])
        read = options.get("read_timeout_s")
        read_s = float(read) if read is not None else min(MAX_DEFAULT_READ_TIMEOUT_S, 0.8 * first_ms / 1000)
        if not 0 < read_s < first_ms / 1000:
            raise ConfigError(
                f"--webhook-read-timeout {read_s:g}s must be positive and shorter than the first retry delay "
                f"({first_ms} ms), so that a retry never overlaps the call it repeats"
            )
        connect = options.get("connect_timeout_s")
        connect_s = float(connect) if connect is not None else min(MAX_CONNECT_TIMEOUT_S, read_s)
        if connect_s <= 0:
            raise ConfigError(f"--webhook-connect-timeout {connect_s:g}s must be positive")
        return cls(str(url), bool(options.get("endpoint_idempotent", True)), connect_s, read_s)


def idempotency_key_header(key: str) -> str:
    """The ``Idempotency-Key`` header value of a fence key (ASCII, reversible)."""
    return quote(key, safe=_KEY_SAFE)


def payload(env: Envelope) -> bytes:
    """The notification of *env*: canonical JSON, so one revision has one body."""
    return canonical_bytes({
        "articleId": env.key,
        "revision": env.revision,
        "published": env.type == PUBLISHED,
        "title": str(env.data["title"]),
        "url": str(env.data["url"]),
    })


def retry_after_s(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds asked for by a ``Retry-After`` header (delay-seconds or an HTTP-date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def provider_id(response: httpx.Response) -> str | None:
    """The provider's id of the effect: the body's ``id``, else a header."""
    try:
        body = orjson.loads(response.content) if response.content else None
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("id"), str | int) and not isinstance(body["id"], bool):
        return safe_reason(str(body["id"]))
    for name in ID_HEADERS:
        if response.headers.get(name):
            return safe_reason(response.headers[name])
    return None


def classify(response: httpx.Response, env: Envelope) -> CallResult:
    """What an HTTP answer means for the fence (the table in docs/fence.md, "The webhook consumer")."""
    status = response.status_code
    if 200 <= status < 300:
        return CallResult(provider_id=provider_id(response), status=status)
    what = f"{response.request.method} answered {status} {response.reason_phrase}".strip()
    if status in (429, 503):
        wait = retry_after_s(response.headers.get("retry-after"))
        code = "endpoint-throttled" if status == 429 else "endpoint-unavailable"
        return CallResult(status=status, failure=TransientError(what, code=code, retry_after_s=wait), stop=True)
    if status in (408, 425):
        return CallResult(status=status, failure=TransientError(what, code="endpoint-not-ready"))
    if status == 409:
        return CallResult(status=status, failure=TransientError(what, code="endpoint-busy"), ambiguous=True)
    if status >= 500:
        return CallResult(status=status, failure=TransientError(what, code="endpoint-error"), ambiguous=True,
                          stop=status in (502, 504))
    return CallResult(status=status, failure=Rejection(ENDPOINT_REJECTED, what, event_id=env.event_id,
                                                       fingerprint=env.fingerprint))


class Notifier:
    """The fenced step: one reused HTTP client, one POST per key."""

    name = STEP
    result = RESULT

    def __init__(self, config: WebhookConfig, *, transport: httpx.BaseTransport | None = None) -> None:
        import httpx  # here, not at the top: the read commands never pay for it

        self.config = config
        self.idempotent = config.idempotent
        self.client = httpx.Client(
            timeout=httpx.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s,
                                  write=config.read_timeout_s, pool=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=4, max_keepalive_connections=4),
            headers={"User-Agent": f"delivery-consumer/{__version__}", "Content-Type": "application/json"},
            follow_redirects=False,
            transport=transport,
        )

    def payload(self, env: Envelope) -> bytes:
        return payload(env)

    def call(self, call: Call) -> CallResult:
        """POST the notification; every failure comes back as a CallResult."""
        import httpx

        try:
            headers = tracing.http_headers({"Idempotency-Key": idempotency_key_header(call.key)})
            response = self.client.post(self.config.url, content=call.payload, headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            # The request never left: calling again cannot repeat an effect.
            return CallResult(failure=TransientError(f"{type(exc).__name__}: {exc}", code="endpoint-unreachable"),
                              stop=True)
        except httpx.TimeoutException as exc:  # read or write timeout: the request may be processed
            return CallResult(failure=TransientError(f"{type(exc).__name__} after {self.config.read_timeout_s:g}s",
                                                     code="endpoint-timeout"), ambiguous=True, stop=True)
        except httpx.HTTPError as exc:  # a cut connection, a protocol error
            return CallResult(failure=TransientError(f"{type(exc).__name__}: {exc}", code="endpoint-error"),
                              ambiguous=True, stop=True)
        return classify(response, call.env)

    def close(self) -> None:
        self.client.close()


@functools.lru_cache(maxsize=8)
def notifier(config: WebhookConfig) -> Notifier:
    """The process's Notifier for *config* (its client and connections are reused)."""
    return Notifier(config)


def external(options: Mapping[str, Any]) -> ExternalBatchFn:
    """``ConsumerSpec.external``: check *options*, return the batch function."""
    step = notifier(WebhookConfig.from_options(options))

    def apply_batch(db: ConsumerDB, parsed: Sequence[Envelope | Rejection],
                    marks: Sequence[DeliveryMark], hooks: WorkHooks) -> list[Outcome]:
        return apply_fenced(db, parsed, marks, step, hooks)

    return apply_batch


def apply(conn: Any, env: Envelope) -> str:
    """Inside a transaction the call cannot be fenced: only ``run`` applies this consumer."""
    raise TransientError("the webhook consumer calls an endpoint: it is applied by run only",
                         code="external-effect")


SPEC = ConsumerSpec(
    name="webhook",
    apply=apply,
    migrations=MIGRATIONS,
    binding_keys=("material.*",),
    description="POSTs each material event to --webhook-url once (fenced by <articleId>:<revision>:notify)",
    tables=("fence",),
    external=external,
)
