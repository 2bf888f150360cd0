"""Consumers and a producer given every node's address survive what happens to a three-node cluster.

Each scenario (tests/clusterkit.py) runs a producer's outbox dispatched by ``dispatch`` and the
catalog and counter consumers' ``run`` processes, all given the three nodes' addresses, while a
node is killed, quorum is lost, or the nodes are restarted one by one. Each checks its ledger:
every event written applied exactly once by each consumer (the counter is not idempotent by
itself), nothing rejected or dead-lettered, no process exited (and each exits 0 on SIGTERM at
the end). The consumption gap is printed (and collected by bench/bench_cluster.py), never
asserted beyond "it resumed with no person" (clusterkit.RESUME_BOUND).
"""

from __future__ import annotations

import pytest
from clusterkit import ClusterNamespace, RabbitCluster, play


def scenario(rabbit_cluster: RabbitCluster, ns: ClusterNamespace, name: str) -> None:
    outcome = play(rabbit_cluster, ns, name)
    print("\n" + outcome.line())


def test_kill_the_node_the_clients_use(rabbit_cluster: RabbitCluster, cluster_ns: ClusterNamespace) -> None:
    """kill -9 of the node every client is connected to: they fail over to the other two and
    the ledger is exact."""
    scenario(rabbit_cluster, cluster_ns, "kill-clients-node")


def test_kill_the_leader_of_the_consumers_queue(rabbit_cluster: RabbitCluster,
                                                cluster_ns: ClusterNamespace) -> None:
    """kill -9 of the node leading the catalog's quorum queue: a new leader is elected, the
    consumers go on, the ledger is exact."""
    scenario(rabbit_cluster, cluster_ns, "kill-leader")


def test_lose_quorum_and_regain_it(rabbit_cluster: RabbitCluster, cluster_ns: ClusterNamespace) -> None:
    """Two of three nodes stopped (no queue has a majority), then started: nothing published is
    lost or applied twice, no process exits, consumption resumes by itself."""
    scenario(rabbit_cluster, cluster_ns, "lose-quorum")


def test_rolling_restart_with_drain(rabbit_cluster: RabbitCluster, cluster_ns: ClusterNamespace) -> None:
    """Each node drained, restarted and revived in turn: the ledger is exact, no process exits."""
    scenario(rabbit_cluster, cluster_ns, "rolling-restart-drain")


def test_rolling_restart_without_drain(rabbit_cluster: RabbitCluster, cluster_ns: ClusterNamespace) -> None:
    """Each node shut down and restarted in turn, no drain: the ledger is exact, no process exits."""
    scenario(rabbit_cluster, cluster_ns, "rolling-restart-no-drain")


@pytest.mark.parametrize("name", ["partitioned-kill-node"])
def test_partitioned_consumer_with_standbys_during_a_node_kill(rabbit_cluster: RabbitCluster,
                                                               cluster_ns: ClusterNamespace, name: str) -> None:
    """The catalog in two partitions, each with an active run and a standby, while the clients'
    node is killed: every event has one receipt in its partition, no run (standby included)
    exits."""
    scenario(rabbit_cluster, cluster_ns, name)
