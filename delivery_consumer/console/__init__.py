"""``delivery-consumer console``: the deployment in a browser.

A page served on 127.0.0.1 by the standard library's HTTP server, rendered on
the server (HTML, inline SVG, no script, no build step): status of every
consumer and producer, outcomes per minute, dead letters grouped by code,
trace search; with ``--allow-actions``, requeue and purge of dead letters
behind a confirmation step and a CSRF token. See docs/console.md.
"""

from .server import Console, make_server

__all__ = ["Console", "make_server"]
