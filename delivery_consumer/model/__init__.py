"""The model: what an event, an event type, a consumer and a rejection are (no I/O, no broker)."""
