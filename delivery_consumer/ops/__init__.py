"""The operator's tools over a deployment: the deployment file, the system view, the dead-queue
tools, recovery, replay, the partitions' databases, the AsyncAPI document."""
