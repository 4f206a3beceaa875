"""The counters a scope exposes as ``scope.stats``."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

__all__ = ["ScopeStats", "compiled_sink", "sink_by_key"]


@dataclass
class ScopeStats:
    """Counters of one scope, readable after the block and updated in backward.

    Each field has one writer: ``ops_recorded`` and ``ops_saved`` are counted by the recorder,
    ``tensors_packed``/``bytes_packed`` by the pack hook, ``replays``/``ops_replayed``
    by replay. Under ``torch.compile`` nothing is recorded in Python: the stats of a
    scope inside compiled code are filled once, when the graph is compiled for
    training (``ops_recorded``: the block's ops in the compiled forward graph;
    ``tensors_packed``/``bytes_packed``: the block tensors the compiled backward
    recomputes instead of saving), and ``replays``, ``ops_replayed`` and ``ops_saved``
    stay 0.

    ``calls_steady`` and ``calls_recorded`` count the calls of a function-form scope
    (``apply_recompute``, ``@recompute``, ``checkpoint``) by the way they ran: bound from a
    template (the steady state, the default on CUDA) or recorded; ``recorded_why`` says why
    each recorded call was (``"off"``: ``GRADIENT_SCOPE_FAST`` is off or, unset, no argument
    is a CUDA tensor; ``"first call"``, ``"first run of a graph"``: what a steady state
    costs first; ``"module hook"``, ``"given up"``, ...: docs/limitations.md).

    Example::

        >>> import torch
        >>> from gradient_scope import recompute_scope
        >>> a = torch.randn(4, requires_grad=True)
        >>> scope = recompute_scope()
        >>> with scope:
        ...     x = a.sin()
        >>> (x * x).sum().backward()
        >>> scope.stats.ops_recorded, scope.stats.tensors_packed
        (1, 2)
    """

    ops_recorded: int = 0  #: operations recorded in the block
    ops_saved: int = 0  #: op calls whose outputs the ``save=`` policy kept (not recorded)
    tensors_packed: int = 0  #: saved-for-backward tensors replaced by handles
    bytes_packed: int = 0  #: bytes autograd did not keep because of those handles
    replays: int = 0  #: recomputation passes run
    ops_replayed: int = 0  #: operations executed by those passes
    calls_steady: int = 0  #: function-form calls bound from a template (the steady state)
    calls_recorded: int = 0  #: function-form calls recorded
    #: why the recorded calls were, reason -> calls
    recorded_why: dict[str, int] = field(default_factory=dict)

    def count_call(self, why: str | None) -> None:
        """Count a function-form call: steady (``why`` None) or recorded for ``why``."""
        if why is None:
            self.calls_steady += 1
        else:
            self.calls_recorded += 1
            self.recorded_why[why] = self.recorded_why.get(why, 0) + 1


# key -> the ScopeStats that compiled scopes of one model helper's module count into (the
# key is an int: what compiled code can pass to the compile adapter as a constant).
_SINKS: weakref.WeakValueDictionary[int, ScopeStats] = weakref.WeakValueDictionary()
_keys = itertools.count(1)


def compiled_sink(stats: ScopeStats) -> int:
    """Register ``stats`` as where compiled scopes given the returned key count (their
    compile-time figures, ``_adapters.compile.graph``); held weakly."""
    key = next(_keys)
    _SINKS[key] = stats
    return key


def sink_by_key(key: int) -> ScopeStats | None:
    """The live stats registered under ``key`` (None: gone, or 0)."""
    return _SINKS.get(key)
