"""Server-side merges of client updates, selectable by name via :func:`get_merge`
(docs/algorithms.md, "What the server does").

Each merge lives in its own module and registers itself with :func:`register_merge`; importing
the module here is all it takes to make it available.
"""

from .averaging import avg_merge, sum_merge
from .base import (
    MERGES,
    ClientUpdate,
    MergeResult,
    apply_delta,
    delta_mapping,
    get_merge,
    register_merge,
    validate_updates,
)
from .firm import firm_merge, normalize_and_sparsify
from .fulm import client_similarity, cluster_clients, fulm_mean_merge, fulm_merge
from .projection import fisher_damage, project_retention
from .ties import ties_combine, ties_merge

__all__ = [
    "MERGES",
    "ClientUpdate",
    "MergeResult",
    "apply_delta",
    "avg_merge",
    "client_similarity",
    "cluster_clients",
    "delta_mapping",
    "firm_merge",
    "fisher_damage",
    "fulm_mean_merge",
    "fulm_merge",
    "get_merge",
    "normalize_and_sparsify",
    "project_retention",
    "register_merge",
    "sum_merge",
    "ties_combine",
    "ties_merge",
    "validate_updates",
]
