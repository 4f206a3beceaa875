"""gradient_scope: say what not to store for backward.

Tensors created inside a :class:`recompute_scope` are not kept for backward;
they are recomputed from a record of the block's ops when backward needs them.
"""

from ._errors import RecomputeError
from ._record import ScopeStats
from ._scope import recompute, recompute_scope

__all__ = ["RecomputeError", "ScopeStats", "recompute", "recompute_scope"]
__version__ = "0.1.0"
