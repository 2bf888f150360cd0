"""RabbitMQ through pika: the only package of delivery_consumer that imports it.

The rest of the code gets plain objects and the project's own errors:

* :mod:`.connection` -- URLs, connection parameters, and pika failures mapped
  to :class:`~..errors.BrokerUnavailable` or :class:`~..errors.BrokerFatal`;
* :mod:`.declare` -- the declare operations of a topology, run on a channel;
* :mod:`.publisher` -- :class:`~.publisher.Publisher` and
  :class:`~.publisher.StreamPublisher`: confirmed publishing for commands;
* :mod:`.consumer` -- :class:`~.consumer.ConsumerIO`, the connection side of ``run``;
* :mod:`.dead_queue` -- :class:`~.dead_queue.DeadQueue`, exclusive access to a dead-letter queue;
* :mod:`.mover` -- :class:`~.mover.WindowReader`: a queue's messages moved in order, a window at a time;
* :mod:`.upgrade` -- a classic queue of an earlier release turned into a quorum queue;
* :mod:`.admin` -- one-shot calls: declare a topology, count queues, delete unused ones.

Importing this package does not import pika; its modules do. See docs/amqp.md.
"""
