"""``run``: a consumer as a RabbitMQ service, acking only after commit.

:mod:`.config` (the options), :mod:`.worker` (batches, commits, copies, acks),
:mod:`.messages` (what the two processes say to each other),
:mod:`.worker_process` and :mod:`.link` (each process's end of the pipe),
:mod:`.run` (starting and stopping both); :mod:`.memory_link` (the worker's
connection in memory, no broker). Design: docs/run.md.
"""
