"""The store: SQLAlchemy Core tables and Alembic migrations over SQLite and PostgreSQL."""

from .address import resolve_store_address
from .agents import Note, Retention, Swept, caller_id_problem
from .capacity import MeasuredCapacity
from .errors import (
    Ambiguous,
    AmbiguousKey,
    KeyAlreadyRevoked,
    KeyNotFound,
    NotFound,
    NotMember,
    StoreError,
    mask_password,
)
from .keyrows import hash_secret
from .leases import Lease, PublishedEndpoint
from .records import (
    CostRow,
    IssuedKey,
    KeyRecord,
    LimitRecord,
    Membership,
    Org,
    Project,
    SessionRecord,
    Team,
    Tree,
    UsageRow,
    User,
)
from .signin import AttemptLimit, CountedAttempt
from .store import Store

__all__ = [
    "Ambiguous",
    "AmbiguousKey",
    "AttemptLimit",
    "CostRow",
    "CountedAttempt",
    "IssuedKey",
    "KeyAlreadyRevoked",
    "KeyNotFound",
    "KeyRecord",
    "Lease",
    "LimitRecord",
    "MeasuredCapacity",
    "Membership",
    "NotFound",
    "NotMember",
    "Note",
    "Org",
    "Project",
    "PublishedEndpoint",
    "Retention",
    "SessionRecord",
    "Store",
    "StoreError",
    "Swept",
    "Team",
    "Tree",
    "UsageRow",
    "User",
    "caller_id_problem",
    "hash_secret",
    "mask_password",
    "resolve_store_address",
]
