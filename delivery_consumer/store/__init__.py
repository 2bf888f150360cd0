"""SQLite as every database here uses it: connect and migrate, the file under operators, what
was acknowledged, which process lives, where each database of a consumer is."""
