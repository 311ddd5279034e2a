"""Server-side merges of client updates (SPEC §2), selectable by name via :func:`get_merge`.

Each merge lives in its own module and registers itself with :func:`register_merge`; importing
the module here is all it takes to make it available.
"""

from .base import MERGES, ClientUpdate, MergeResult, get_merge, register_merge, validate_updates
from .firm import firm_merge, normalize_and_sparsify
from .projection import fisher_damage, project_retention

__all__ = [
    "MERGES",
    "ClientUpdate",
    "MergeResult",
    "firm_merge",
    "fisher_damage",
    "get_merge",
    "normalize_and_sparsify",
    "project_retention",
    "register_merge",
    "validate_updates",
]
