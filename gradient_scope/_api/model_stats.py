"""``model_stats(model)``: the counters of the scopes a model's helpers ran, summed."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch.nn as nn

from .._base.stats import ScopeStats
from .checkpoint import checkpoint_compiled, checkpoint_stats, reset_checkpoint_stats
from .helpers import reset_scoped_forward_stats, scoped_forward_compiled, scoped_forward_stats

__all__ = ["ModelStats", "model_stats"]

_COUNTERS = tuple(f.name for f in fields(ScopeStats))


@dataclass
class ModelStats(ScopeStats):
    """The counters of every scope run by a model's scoped modules, summed (the
    fields of :class:`ScopeStats`), and per module in ``modules``.

    Example::

        >>> import torch
        >>> import torch.nn as nn
        >>> from gradient_scope import apply_recompute, model_stats
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        >>> _ = apply_recompute(model, check_fn=nn.Tanh)
        >>> model(torch.randn(4, 8)).sum().backward()
        >>> stats = model_stats(model)
        >>> stats.tensors_packed, sorted(stats.modules)
        (3, ['1', '3'])
        >>> stats.modules["1"].replays
        1
    """

    #: module path (from the model; ``""`` for the model itself) -> its scopes' counters
    modules: dict[str, ScopeStats] = field(default_factory=dict)
    #: module path -> what the compiled graphs of its scopes (``apply_recompute``'s, and
    #: ``checkpoint(module, ...)`` calls in compiled code) hold, once per graph compiled:
    #: ``ops_recorded``, the block's ops in the compiled forward graphs; ``tensors_packed`` /
    #: ``bytes_packed``, the block tensors the compiled backward recomputes instead of saving.
    #: Scopes in compiled graphs count nothing per call (no Python runs per op there): the
    #: counters above stay 0 for them, and this says what the graphs do.
    compiled: dict[str, ScopeStats] = field(default_factory=dict)

    def __str__(self) -> str:
        """The totals in one line, and, when modules ran in compiled graphs, a second that
        says so and what those graphs recompute.

        Example::

            >>> print(ModelStats(ops_recorded=2, tensors_packed=1, bytes_packed=64, replays=1, ops_replayed=2))
            ops_recorded=2 tensors_packed=1 bytes_packed=64 replays=1 ops_replayed=2 (0 scoped modules)
        """
        # ops_saved and how function-form calls ran only where there is something to say
        optional = ("ops_saved", "calls_steady", "calls_recorded", "recorded_why")
        line = " ".join(f"{n}={getattr(self, n)}" for n in _COUNTERS if n not in optional or getattr(self, n))
        line += f" ({len(self.modules)} scoped modules)"
        if not self.compiled:
            return line
        total = ScopeStats()
        for stats in self.compiled.values():
            _add(total, stats)
        return (
            f"{line}\ncompiled: {len(self.compiled)} scoped modules ran in torch.compile graphs, where scopes "
            "count nothing per call (the counters above leave them out); their compiled graphs recompute "
            f"{total.tensors_packed} tensors ({total.bytes_packed} bytes) of {total.ops_recorded} block ops "
            "(per module: .compiled)"
        )

    def __sub__(self, before: ModelStats) -> ModelStats:
        """The counts since ``before`` (an earlier ``model_stats(model)`` of the same model):
        per step, ``after - before``; modules that did not change are left out.

        Example::

            >>> import torch
            >>> import torch.nn as nn
            >>> from gradient_scope import apply_recompute, model_stats
            >>> model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            >>> _ = apply_recompute(model, check_fn=nn.Tanh)
            >>> before = model_stats(model)
            >>> model(torch.randn(4, 8)).sum().backward()
            >>> step = model_stats(model) - before
            >>> step.replays, step.modules["1"].tensors_packed
            (1, 1)
        """
        if not isinstance(before, ModelStats):
            return NotImplemented
        out = ModelStats()
        _add(out, self)
        _add(out, before, -1)
        for name, stats in self.modules.items():
            diff = ScopeStats()
            _add(diff, stats)
            if name in before.modules:
                _add(diff, before.modules[name], -1)
            if diff != ScopeStats():
                out.modules[name] = diff
        out.compiled = dict(self.compiled)  # (what the graphs hold, not a count per step)
        return out


def _add(into: ScopeStats, stats: ScopeStats, sign: int = 1) -> None:
    for name in _COUNTERS:
        if name == "recorded_why":
            why = into.recorded_why
            for k, n in stats.recorded_why.items():
                why[k] = why.get(k, 0) + sign * n
                if not why[k]:
                    del why[k]
        else:
            setattr(into, name, getattr(into, name) + sign * getattr(stats, name))


def model_stats(model: nn.Module, *, reset: bool = False) -> ModelStats:
    """Sum the stats of every scope run by ``model``'s scoped modules.

    Counts the scopes that :func:`apply_recompute` runs for each module it
    wrapped (since that call), and those that :func:`checkpoint` runs for a
    module (called as ``checkpoint(module, ...)``, a bound method of it, or a
    ``functools.partial`` of one, as Hugging Face transformers does). Scopes
    in compiled code count nothing per call; ``compiled`` says what their
    graphs recompute, per module, for both helpers. The
    counters keep counting through backward (``replays``, ``ops_replayed``).
    Reading them costs nothing while the model runs: the scopes of one module
    count into one shared :class:`ScopeStats`.

    The counts accumulate over every step since ``apply_recompute`` or the last
    reset. Per step: ``model_stats(model, reset=True)`` after each backward, or
    ``after - before`` of two readings (:meth:`ModelStats.__sub__`), which
    leaves the counts alone (``compiled``, what compiled graphs hold, stays).
    ``replays`` counts recomputation passes, not layers: a backward may replay a
    block in more than one pass, when it needs
    the block's values at two moments (see the docs' Debugging page).

    Args:
        model: the model; its submodules are named by their path from it.
        reset: start the counts afresh after reading them (scopes that ran
            before keep counting into the counts returned).

    Returns:
        A :class:`ModelStats`: the totals, and ``modules``, one
        :class:`ScopeStats` per module whose scopes ran, by path.

    Example::

        >>> import torch
        >>> import torch.nn as nn
        >>> import gradient_scope
        >>> mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        >>> model = nn.Sequential(mlp, nn.Linear(8, 1))
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> model[1](gradient_scope.checkpoint(mlp, x)).sum().backward()
        >>> stats = gradient_scope.model_stats(model, reset=True)
        >>> list(stats.modules), stats.ops_recorded > 0, stats.replays
        (['0'], True, 1)
        >>> gradient_scope.model_stats(model).ops_recorded
        0
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_stats: model must be a torch.nn.Module, got {type(model).__name__}")
    total = ModelStats()
    # A parent whose weights are all one child's shares its entry: the deepest module
    # (the last in this pre-order walk) is the one checkpoint ran.
    by_entry = {}
    for name, module in model.named_modules():
        entry = checkpoint_compiled(module)
        if entry is not None:
            by_entry[id(entry)] = (name, entry)
    checkpointed = dict(by_entry.values())
    for name, module in model.named_modules():
        found = [s for s in (scoped_forward_stats(module), checkpoint_stats(module)) if s is not None]
        graphs = [s for s in (scoped_forward_compiled(module), checkpointed.get(name)) if s is not None]
        if not found and not graphs:
            continue
        if graphs:
            compiled = ScopeStats()
            for stats in graphs:
                _add(compiled, stats)
            total.compiled[name] = compiled
        per_module = ScopeStats()
        for stats in found:
            _add(per_module, stats)
        _add(total, per_module)
        total.modules[name] = per_module
        if reset:
            reset_scoped_forward_stats(module)
            reset_checkpoint_stats(module)
    return total
