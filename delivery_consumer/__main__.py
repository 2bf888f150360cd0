"""``python -m delivery_consumer`` is the ``delivery-consumer`` command."""

from .cli import main

main(prog_name="delivery-consumer")
