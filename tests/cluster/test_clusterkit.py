"""The three-node cluster the cluster scenarios run on (tests/clusterkit.py) is what it says."""

from __future__ import annotations

import pika
from brokerkit import Namespace
from clusterkit import RabbitCluster


def test_three_nodes_run_in_one_cluster_and_replicate_quorum_queues(rabbit_cluster: RabbitCluster,
                                                                     cluster_ns: Namespace) -> None:
    """Each node takes connections on its own port, all three see each other running, and a
    quorum queue declared through one node has a member on each of the three."""
    assert len({n.port for n in rabbit_cluster.nodes}) == 3
    assert rabbit_cluster.running_nodes() == {n.name for n in rabbit_cluster.nodes}
    queue = f"{cluster_ns.prefix}.kit"
    conn = pika.BlockingConnection(pika.URLParameters(rabbit_cluster.nodes[1].url))
    try:
        conn.channel().queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
    finally:
        conn.close()
    try:
        row = rabbit_cluster.queues()[queue]
        assert sorted(row["members"]) == sorted(n.name for n in rabbit_cluster.nodes)
        assert rabbit_cluster.leader(queue) in rabbit_cluster.nodes
    finally:
        conn, ch = cluster_ns.channel()
        ch.queue_delete(queue)
        conn.close()


def test_a_killed_leader_is_replaced_and_the_node_rejoins(rabbit_cluster: RabbitCluster,
                                                          cluster_ns: Namespace) -> None:
    """SIGKILL of a quorum queue's leader: another member leads it; the killed node, started
    again, is back in the cluster with its member online, and no beam of it is left over."""
    queue = f"{cluster_ns.prefix}.kit"
    conn, ch = cluster_ns.channel()
    ch.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
    conn.close()
    try:
        leader = rabbit_cluster.leader(queue)
        leader.kill()
        assert not leader.running
        assert rabbit_cluster.leader(queue) is not leader
        leader.launch()
        rabbit_cluster.wait_whole()
        rabbit_cluster.wait_members_online(queue)
    finally:
        conn, ch = cluster_ns.channel()
        ch.queue_delete(queue)
        conn.close()
