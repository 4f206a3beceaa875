"""gradient_scope: say what not to store for backward.

Tensors created inside a :class:`recompute_scope` are not kept for backward;
they are recomputed from a record of the block's ops when backward needs them.
"""

# First: raises ImportError naming the torch floor before any module below touches
# torch's private APIs.
from ._base import torch_floor as _torch_floor  # noqa: F401

# isort: split

from typing import Any

from ._adapters import fsdp as _fsdp
from ._adapters.steady import run as _steady
from ._api import calibrate as _calibrate
from ._api import scope as _scope
from ._api.checkpoint import checkpoint
from ._api.helpers import apply_recompute, recompute_sequential, remove_recompute
from ._api.model_stats import ModelStats, model_stats
from ._api.scope import recompute, recompute_scope
from ._base.errors import RecomputeError
from ._base.options import disabled
from ._base.stats import ScopeStats
from ._base.version import __version__ as __version__
from ._budget import agree as _agree
from ._budget import offload as _offload
from ._budget import rates as _rates
from ._budget.budget import Budget
from ._record import recorder as _recorder
from ._record import registry as _registry
from ._report.report import SavedTensorsReport, SavedTensorsRow, saved_tensors_report
from ._restore import replay as _replay
from ._save import interception as _interception
from .policies import OpContext, context_policy, name_region, save_any, save_attention, save_matmuls, save_nothing


def _traced_block(*args: Any, **options: Any) -> Any:
    """``recompute_scope(...)`` while dynamo traces (``_adapters.compile.graph``, which imports
    ``torch._dynamo``, is imported only then)."""
    from ._adapters.compile import graph as _compile

    return _compile.traced_block(*args, **options)


# The seams: every callback a layer gives a lower one (docs/internals.md), registered here
# and nowhere else; each registration returns its remover (kept here, in order).
_SEAMS = (
    # Our pair leaves the stack once the last block tensor of a thread died
    # (I4 [ stacks edited at safe points only ], I8 [ the main thread's pair, removed later ]).
    _registry.add_empty_listener(_interception.on_empty),
    # A budget's kept input offloaded in place comes back for its replay
    # (O5 [ kept inputs are offloaded in place ]).
    _replay.add_freed_storage_handler(_offload.restore_offloaded),
    # FSDP2 (imports no torch.distributed): freed parameter storage gathered back for a
    # replay; a block's buffers released at its close.
    _replay.add_freed_storage_handler(_fsdp.on_freed),
    _recorder.add_close_listener(_fsdp.release_buffers),
    # What a scope is while dynamo traces.
    _scope.set_traced_block(_traced_block),
    # A function-form scope whose function dynamo captures runs without the recorder once
    # its graph was recorded (imports no torch._dynamo until a function is captured).
    _scope.set_steady_runner(_steady.run),
    # A budget's predicted times count what autograd and the library cost per op, measured
    # once per device by running scopes (``_api.calibrate``).
    _rates.set_calibration(_calibrate.library_costs),
    # A budget's plan is agreed across ranks where a replay may run FSDP2's all-gather
    # (A1 [ a shared block needs one plan ]).
    _agree.add_shared_check(_fsdp.gathered),
)

__all__ = [
    "Budget",
    "ModelStats",
    "OpContext",
    "RecomputeError",
    "SavedTensorsReport",
    "SavedTensorsRow",
    "ScopeStats",
    "apply_recompute",
    "checkpoint",
    "context_policy",
    "disabled",
    "model_stats",
    "name_region",
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
