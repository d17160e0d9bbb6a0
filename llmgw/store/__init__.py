"""The store: SQLAlchemy Core tables and Alembic migrations over SQLite and PostgreSQL."""

from .address import resolve_store_address
from .errors import AmbiguousKey, KeyAlreadyRevoked, KeyNotFound, StoreError, mask_password
from .records import KeyRecord, UsageRow
from .store import Store, hash_secret

__all__ = ["AmbiguousKey", "KeyAlreadyRevoked", "KeyNotFound", "KeyRecord", "Store",
           "StoreError", "UsageRow", "hash_secret", "mask_password", "resolve_store_address"]
