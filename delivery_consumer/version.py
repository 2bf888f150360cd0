"""The package's release, in a leaf module: the package's modules read it here, never
from the package itself (whose face loads the service on first use)."""

#: Raised on every release that changes the database schema or the wire
#: contract (CHANGELOG.md); a database records the release that last migrated it.
__version__ = "0.2.0"

__all__ = ["__version__"]
