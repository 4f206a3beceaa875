"""gradient_scope: say what not to store for backward.

Tensors created inside a :class:`recompute_scope` are not kept for backward;
they are recomputed from a record of the block's ops when backward needs them.
"""

# First: raises ImportError naming the torch floor before any module below touches
# torch's private APIs.
from . import _torch_floor  # noqa: F401

# isort: split

from typing import Any

from . import _fsdp, _scope
from ._budget import Budget
from ._checkpoint import checkpoint
from ._errors import RecomputeError
from ._helpers import apply_recompute, recompute_sequential, remove_recompute
from ._model_stats import ModelStats, model_stats
from ._options import disabled
from ._report import SavedTensorsReport, SavedTensorsRow, saved_tensors_report
from ._scope import recompute, recompute_scope
from ._stats import ScopeStats
from ._version import __version__ as __version__
from .policies import save_any, save_attention, save_matmuls, save_nothing

# The adapters, registered with the core (see docs/internals.md). FSDP2: brings back
# freed parameter storage for a replay (imports no torch.distributed).
_fsdp.install()


def _traced_block(*args: Any, **options: Any) -> Any:
    """``recompute_scope(...)`` while dynamo traces (``_compile``, which imports
    ``torch._dynamo``, is imported only then)."""
    from . import _compile

    return _compile.traced_block(*args, **options)


_scope.set_traced_block(_traced_block)

__all__ = [
    "Budget",
    "ModelStats",
    "RecomputeError",
    "SavedTensorsReport",
    "SavedTensorsRow",
    "ScopeStats",
    "apply_recompute",
    "checkpoint",
    "disabled",
    "model_stats",
    "recompute",
    "recompute_scope",
    "recompute_sequential",
    "remove_recompute",
    "save_any",
    "save_attention",
    "save_matmuls",
    "save_nothing",
    "saved_tensors_report",
]
