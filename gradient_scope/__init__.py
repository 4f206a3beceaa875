"""gradient_scope: say what not to store for backward.

Tensors created inside a :class:`recompute_scope` are not kept for backward;
they are recomputed from a record of the block's ops when backward needs them.
"""

from ._errors import RecomputeError
from ._helpers import apply_recompute, recompute_sequential, remove_recompute
from ._scope import recompute, recompute_scope
from ._stats import ScopeStats
from .policies import save_any, save_attention, save_matmuls, save_nothing

__all__ = [
    "RecomputeError",
    "ScopeStats",
    "apply_recompute",
    "recompute",
    "recompute_scope",
    "recompute_sequential",
    "remove_recompute",
    "save_any",
    "save_attention",
    "save_matmuls",
    "save_nothing",
]
__version__ = "0.1.0"
