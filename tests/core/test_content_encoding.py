"""Compressed bodies: gzip and deflate are read within the size limit of the DECOMPRESSED body; a bomb is
refused without being inflated; any other encoding is refused with a reason that names it."""

from __future__ import annotations

import gzip
import tracemalloc
import zlib
from collections.abc import Callable

import pika
import pytest
from brokerkit import Namespace
from hypothesis import given, settings
from hypothesis import strategies as st
from support import body, make_envelope, read_rows

from delivery_consumer.amqp.admin import declare
from delivery_consumer.amqp.dead_queue import HeldMessage
from delivery_consumer.amqp.publisher import properties
from delivery_consumer.amqp.topology import Topology
from delivery_consumer.model import envelope
from delivery_consumer.model.envelope import decode_body, parse
from delivery_consumer.model.errors import Rejection
from delivery_consumer.ops import deadletters


def raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-15)
    return compressor.compress(data) + compressor.flush()


#: (content_encoding, kombu's compression header, compress): how producers send compressed bodies.
ENCODERS: list[tuple[str | None, str | None, Callable[[bytes], bytes]]] = [
    ("gzip", None, gzip.compress),
    ("x-gzip", None, gzip.compress),
    ("gzip:UTF-8", None, gzip.compress),  # Spring AMQP's GZipPostProcessor writes the charset after a colon
    ("GZIP", None, zlib.compress),  # a zlib stream labelled gzip, as kombu's "gzip" is
    ("deflate", None, zlib.compress),  # HTTP's "deflate" is a zlib stream ...
    ("deflate", None, raw_deflate),  # ... which some send raw
    ("utf-8", "application/x-gzip", zlib.compress),  # kombu: compression="gzip"
]
IDS = ["gzip", "x-gzip", "spring", "zlib-as-gzip", "deflate-zlib", "deflate-raw", "kombu"]


def decode(encoded: bytes, encoding: str | None, header: str | None, limit: int) -> bytes:
    return decode_body(encoded, encoding, compression=header, max_bytes=limit)


@pytest.mark.parametrize(("encoding", "header", "compress"), ENCODERS, ids=IDS)
def test_a_compressed_envelope_is_the_same_event(encoding: str, header: str | None,
                                                 compress: Callable[[bytes], bytes]) -> None:
    """A compressed envelope parses to the event of its plain bytes, with the same fingerprint."""
    plain = body(make_envelope())

    got = parse(compress(plain), content_encoding=encoding, compression=header)

    assert parse(plain) == got


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=3000) | st.text(max_size=2000).map(str.encode), limit=st.integers(1, 2500),
       encoder=st.sampled_from(ENCODERS))
def test_decode_undoes_compress_under_the_limit_and_refuses_over_it(
        data: bytes, limit: int, encoder: tuple[str, str | None, Callable[[bytes], bytes]]) -> None:
    """decode(compress(x)) == x when x fits the limit; otherwise invalid-envelope naming the limit."""
    encoding, header, compress = encoder
    encoded = compress(data)

    if len(data) <= limit:
        assert data == decode(encoded, encoding, header, limit)
    else:
        with pytest.raises(Rejection) as info:
            decode(encoded, encoding, header, limit)
        assert "invalid-envelope" == info.value.code
        assert f"more than the limit of {limit} bytes" in info.value.reason


@settings(max_examples=20, deadline=None)
@given(size=st.integers(4 << 20, 64 << 20), encoder=st.sampled_from(ENCODERS))
def test_a_bomb_is_refused_without_being_inflated(size: int, encoder: tuple[str, str | None,
                                                                            Callable[[bytes], bytes]]) -> None:
    """A few KiB that inflate to many MiB are refused while memory stays near the limit, not the bomb's size."""
    encoding, header, compress = encoder
    bomb = compress(bytes(size))
    limit = 64 << 10
    tracemalloc.start()
    try:
        with pytest.raises(Rejection) as info:
            decode(bomb, encoding, header, limit)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert "invalid-envelope" == info.value.code
    assert peak < 4 * limit + len(bomb), peak


@pytest.mark.parametrize(("encoding", "header", "named"), [
    ("br", None, "content-encoding 'br' is not supported"),
    ("compress", None, "content-encoding 'compress' is not supported"),
    ("gzip, gzip", None, "content-encoding 'gzip, gzip' is not supported"),
    ("zstd", None, "content-encoding 'zstd' is not supported"),
    ("utf-8", "application/x-bz2", "compression 'application/x-bz2' is not supported"),
    (None, "application/x-lzma", "compression 'application/x-lzma' is not supported"),
])
def test_an_unknown_encoding_is_refused_naming_it(encoding: str | None, header: str | None, named: str) -> None:
    """An encoding we cannot read is malformed-json with a reason that names it (never a UTF-8 complaint)."""
    with pytest.raises(Rejection) as info:
        parse(gzip.compress(body(make_envelope())), content_encoding=encoding, compression=header)

    assert "malformed-json" == info.value.code
    assert named in info.value.reason


@pytest.mark.parametrize("encoding", [None, "", "identity", "utf-8", "UTF8", "binary"])
def test_identity_encodings_read_the_bytes_as_they_are(encoding: str | None) -> None:
    """No encoding, or one that only names the charset, reads the body as is, with the usual size limit."""
    plain = body(make_envelope())

    assert parse(plain) == parse(plain, content_encoding=encoding)
    with pytest.raises(Rejection, match=f"body is {len(plain)} bytes, over the limit of 10"):
        parse(plain, content_encoding=encoding, max_bytes=10)


@pytest.mark.parametrize(("encoded", "encoding"), [
    (gzip.compress(b'{"a": 1}', mtime=0)[:-12], "gzip"),  # cut short
    (b"not compressed at all", "gzip"),
    (b"", "gzip"),
    (b"not compressed at all", "deflate"),
    (gzip.compress(b"{}", mtime=0) + b"trailing garbage", "gzip"),
])
def test_damaged_compressed_data_is_malformed(encoded: bytes, encoding: str) -> None:
    """Data that is not a whole stream of its encoding is malformed-json, saying which encoding."""
    with pytest.raises(Rejection) as info:
        parse(encoded, content_encoding=encoding)

    assert "malformed-json" == info.value.code
    assert f"body is not valid {encoding} data" in info.value.reason


def test_several_gzip_members_are_one_body() -> None:
    """Concatenated gzip members (allowed by RFC 1952) are one body, within one limit."""
    plain = body(make_envelope())
    half = len(plain) // 2

    assert plain == decode_body(gzip.compress(plain[:half]) + gzip.compress(plain[half:]), "gzip")
    with pytest.raises(Rejection, match="more than the limit"):
        decode_body(gzip.compress(plain[:half]) + gzip.compress(plain[half:]), "gzip", max_bytes=len(plain) - 1)


def test_an_undeclared_gzip_body_says_what_it_looks_like() -> None:
    """A gzip body without a content-encoding is refused with the likely cause, not only 'not UTF-8'."""
    with pytest.raises(Rejection) as info:
        parse(gzip.compress(body(make_envelope())))

    assert "malformed-json" == info.value.code
    assert "looks gzip-compressed, but no content-encoding says so" in info.value.reason


def test_the_kombu_header_name_is_the_one_kombu_writes() -> None:
    """kombu puts the compression in the 'compression' header."""
    assert "compression" == envelope.KOMBU_COMPRESSION_HEADER


@pytest.mark.parametrize(("encoding", "header", "compress"), ENCODERS, ids=IDS)
def test_a_compressed_dead_letter_keeps_its_identity_and_its_encoding(
        encoding: str, header: str | None, compress: Callable[[bytes], bytes]) -> None:
    """dead list reads the eventId of a compressed dead letter; dead requeue sends it with its encoding."""
    env = make_envelope(event_id=None)
    held = HeldMessage(tag=1, body=compress(body(env)), message_id=None,
                       headers={"compression": header} if header else {}, content_type="application/json",
                       redelivered=False, exchange="", routing_key="material.published",
                       content_encoding=encoding)

    letter = deadletters.describe(0, held)
    copy = deadletters.requeue_copy(held, letter, Topology(consumer="catalog"), "2026-12-01T00:00:00Z")

    assert env["eventId"] == letter.event_id
    assert (held.body, encoding) == (copy.body, copy.content_encoding)
    assert header == properties(copy).headers.get("compression")


# -- through the broker ------------------------------------------------------------------------------


def test_compressed_deliveries_through_run(ns: Namespace) -> None:
    """run applies a gzip delivery (also after a retry: the copy keeps its encoding) and a kombu-style one, and
    dead-letters a bomb (invalid-envelope) and an unknown encoding (malformed-json), keeping their encoding."""
    import flaky_consumer  # noqa: F401  (registers the "flaky" consumer in this process too)

    retried = make_envelope(event_id=None, article_id="gzip", title="transient:1")
    kombu = make_envelope(event_id=None, article_id="kombu")
    declare(ns.url, [ns.topology("flaky")])
    conn, channel = ns.channel()
    try:
        channel.confirm_delivery()
        for payload, props in [
            (gzip.compress(body(retried)), pika.BasicProperties(content_encoding="gzip", delivery_mode=2)),
            (zlib.compress(body(kombu)), pika.BasicProperties(content_type="application/json",
                                                              content_encoding="utf-8", delivery_mode=2,
                                                              headers={"compression": "application/x-gzip"})),
            (gzip.compress(bytes(32 << 20)), pika.BasicProperties(content_encoding="gzip", delivery_mode=2)),
            (body(make_envelope(event_id=None)), pika.BasicProperties(content_encoding="br", delivery_mode=2)),
        ]:
            channel.basic_publish(ns.exchange, "material.published", payload, props, mandatory=True)
    finally:
        conn.close()

    done = ns.run_until_idle("flaky", "--retry-delays", "100ms", env=ns.env(
        DELIVERY_PLUGINS="flaky_consumer", FLAKY_DIR=str(ns.workdir / "flaky")), idle=3)

    assert 0 == done.returncode, done.stderr
    assert "retry copy sent" in done.stderr
    assert sorted([(retried["eventId"], "recorded"), (kombu["eventId"], "recorded")]) == read_rows(
        ns.db("flaky"), "inbox", "event_id, result")
    dead = ns.drain(ns.topology("flaky").dead_queue)
    assert [("gzip", "invalid-envelope"), ("br", "malformed-json")] == [
        (props.content_encoding, props.headers["x-error-code"]) for props, _ in dead]
    assert "content-encoding 'br' is not supported" in dead[1][0].headers["x-error-reason"]
