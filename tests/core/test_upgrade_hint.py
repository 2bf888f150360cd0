"""The one line a refused declare becomes when an earlier release left a classic dead queue or marker."""

from __future__ import annotations

from delivery_consumer.amqp.partitions import partition_topology
from delivery_consumer.amqp.topology import Topology, classic_leftover, upgrade_hint


def refusal(queue: str) -> str:
    return (f"broker refused (amqp://guest@127.0.0.1:5672//): 406 precondition failed: PRECONDITION_FAILED - "
            f"inequivalent arg 'x-queue-type' for queue '{queue}' in vhost '/': received 'quorum' but current "
            "is 'classic'")


def test_a_classic_dead_queue_or_marker_names_the_upgrade() -> None:
    """A partition's classic dead queue and the classic marker are named with the command to run (the
    prefix given when it is not the default); any other refusal is left as it was."""
    base = Topology("catalog", prefix="shop")
    part = partition_topology(base, 3, 4)
    assert classic_leftover(refusal(part.dead_queue), base) == "shop.catalog.p3.dead"
    line = upgrade_hint(refusal(base.count_marker), base)
    assert line.startswith("shop.catalog.partitions is a classic queue declared by an earlier release")
    assert "delivery-consumer topology upgrade --consumer catalog --queue-prefix shop once" in line
    assert "--queue-prefix" not in upgrade_hint(refusal("delivery.catalog.dead"), Topology("catalog"))
    other = refusal("shop.audit.dead")
    assert upgrade_hint(other, base) == other
    mismatch = refusal(base.queue).replace("x-queue-type", "x-delivery-limit")
    assert upgrade_hint(mismatch, base) == mismatch
