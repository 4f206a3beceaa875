"""Strategies side by side on one model: memory, agreement with plain, interleaved timing.

A :class:`Case` is a model (the zoo builds it) with its loss and its layers. Each strategy
runs on its own deep copy of the case's model (:class:`Runner`), from the same weights,
batch and seed. :func:`run_strategies` gives each strategy a few warm-up steps (a
``Budget`` plans from its first step on; caches, allocator), one step under the memory
probe (bytes held after forward, peak of forward + backward, gradients), optional
training steps (AdamW), and compares gradients, losses and buffers with plain's; then it
times forward and backward of every strategy in interleaved rounds.
"""

from __future__ import annotations

import copy
import functools
import gc
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

import gradient_scope

from .memory import measure
from .strategies import Selector, apply_strategy, compare_tensors, plain_name
from .timing import (
    PHASES,
    frozen_gc,
    interception_gone,
    interleaved_rounds,
    ratio_summary,
    time_fwd_bwd,
    warn_if_interception_left,
)

__all__ = ["Case", "Runner", "run_strategies", "layer_input_bytes", "free_device_memory"]

_COUNTERS = ("ops_recorded", "ops_saved", "tensors_packed", "bytes_packed", "replays", "ops_replayed")


@dataclass
class Case:
    """A model to run strategies on: ``loss(model)`` runs it (the model or a copy) on its batch."""

    name: str
    model: nn.Module
    loss: Callable[[nn.Module], torch.Tensor]
    layers: Selector
    parts: dict[str, Selector] = field(default_factory=dict)
    device: str = "cpu"
    config: dict[str, Any] = field(default_factory=dict)
    batch: tuple[torch.Tensor, ...] = ()  # the batch's tensors (not activations: the ideal analysis)

    def warm_up(self, seed: int = 0) -> None:
        """One fwd+bwd on the model itself, so that lazy initialisation happens before any
        copy is made (no strategy pays for it in memory)."""
        torch.manual_seed(seed)
        self.loss(self.model).backward()
        self.model.zero_grad(set_to_none=True)


def free_device_memory(device: str) -> None:
    """Collect garbage and, on CUDA, return cached blocks (after an error or a model)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


class Runner:
    """One strategy on its own copy of the case's model.

    ``share_params``: the copy shares the base's parameters (and so their gradients), which
    keeps one set of weights in memory for every strategy; only for runs without optimizer
    steps. ``lr``: train with AdamW. ``compile_kw``: call the copy through
    ``torch.compile(copy, **compile_kw)``.
    """

    def __init__(
        self,
        case: Case,
        name: str,
        plain_held: int | None = None,
        share_params: bool = False,
        lr: float | None = None,
        compile_kw: dict[str, Any] | None = None,
    ) -> None:
        self.case, self.name, self.device = case, name, case.device
        memo: dict[int, Any] = {id(p): p for p in case.model.parameters()} if share_params else {}
        self.model = copy.deepcopy(case.model, memo)
        self.budget = apply_strategy(self.model, name, case.layers, case.parts, plain_held)
        self.call: Callable[..., Any] = (
            self.model if compile_kw is None else torch.compile(self.model, **compile_kw)
        )
        self.opt = None if lr is None else torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.warnings: list[str] = []

    def forward(self) -> torch.Tensor:
        return self.case.loss(self.call)  # type: ignore[arg-type]

    def step(self, seed: int | None = None) -> None:
        """One fwd+bwd (no optimizer step); seeded with ``seed`` when given."""
        self.model.zero_grad(set_to_none=True)
        if seed is not None:
            torch.manual_seed(seed)
        self.forward().backward()
        warn_if_interception_left(self.name, self.warnings)

    def profiled_step(self, seed: int, probe: bool = True) -> dict[str, Any]:
        """One step under the memory probe (``probe``): held, peak, loss, gradients; then the
        optimizer step."""
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        gc.collect()
        if probe:
            loss, held, peak = measure(self.forward, lambda loss: loss.backward(), self.device)
            out = {"held": held, "peak": peak}
        else:
            loss, out = self.forward(), {}
            loss.backward()
        out.update(loss=loss.detach().clone(), grads=self.grads())
        del loss
        if self.opt is not None:
            self.opt.step()
        warn_if_interception_left(self.name, self.warnings)
        return out

    def train_step(self, seed: int) -> torch.Tensor:
        """One fwd+bwd+AdamW step from ``torch.manual_seed(seed)``; returns the loss."""
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = self.forward()
        loss.backward()
        assert self.opt is not None
        self.opt.step()
        warn_if_interception_left(self.name, self.warnings)
        return loss.detach().clone()

    def timed_step(self, inner: int = 1) -> dict[str, float]:
        """``inner`` fwd+bwd steps (gradients set to None before each, no optimizer step):
        seconds per phase, the least of the ``inner`` steps (the time of a step is its
        own plus whatever interrupted it: the least is the closest to its own)."""
        ts = []
        for _ in range(inner):
            self.model.zero_grad(set_to_none=True)
            ts.append(time_fwd_bwd(self.forward, lambda loss: loss.backward(), self.device))
        warn_if_interception_left(self.name, self.warnings)
        return {k: min(t[k] for t in ts) for k in ts[0]}

    def grads(self) -> dict[str, torch.Tensor]:
        """Copies of the gradients, by parameter name without checkpoint_wrapper's level."""
        return {plain_name(n): p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def buffers(self) -> dict[str, torch.Tensor]:
        """Copies of all buffers (BatchNorm statistics, ...), by plain name."""
        return {plain_name(n): b.detach().clone() for n, b in self.model.named_buffers()}


def layer_input_bytes(case: Case) -> int | None:
    """Bytes of the first layer's hidden-state input (the unit of a per-layer excess)."""
    layer = next((m for m in case.model.modules() if case.layers(m)), None)
    if layer is None:
        return None
    seen: list[int] = []

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        if not seen and isinstance(x, torch.Tensor):
            seen.append(x.numel() * x.element_size())

    h = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            case.loss(case.model)
    finally:
        h.remove()
    return seen[0] if seen else None


def _agreement(outcome: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    return {
        "grads_vs_plain": compare_tensors(outcome["grads"], ref["grads"]),
        "losses_vs_plain": compare_tensors(
            {str(i): x for i, x in enumerate(outcome["losses"])}, {str(i): x for i, x in enumerate(ref["losses"])}
        ),
        "buffers_vs_plain": compare_tensors(outcome["buffers"], ref["buffers"]),
    }


@frozen_gc()  # the gc.collect() before each step then only sees this run's objects
def run_strategies(
    case: Case,
    strategies: Sequence[str],
    rounds: int,
    *,
    seed: int = 0,
    warmup: int = 2,
    train_steps: int = 1,
    inner: int = 1,
    memory: bool = True,
    lr: float = 1e-3,
    compile_kw: dict[str, Any] | None = None,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every strategy on ``case`` (``plain`` first: the others are compared with it, and
    budgets are fractions of its held bytes); see the module docstring.

    Returns ``{"strategies": {name: results}, "warnings": [...], "rounds": rounds run}``.
    A strategy that raises is reported with its ``error`` and left out of the timing.
    Each timing round takes the least of ``inner`` steps per strategy (:meth:`Runner.timed_step`).
    ``memory=False``: only plain's step goes through the memory probe (budgets need its bytes).
    With ``deadline`` (``time.perf_counter()``), strategies other than plain not started by then are
    skipped and no timing round starts after it. ``rounds=0``: memory and agreement only.
    """
    if not strategies or strategies[0] != "plain":
        raise ValueError("run_strategies: the first strategy must be 'plain'")
    share = train_steps <= 1  # no optimizer steps: one set of weights serves every copy
    res: dict[str, dict[str, Any]] = {}
    runners: dict[str, Runner] = {}
    ref: dict[str, Any] | None = None
    plain_held: int | None = None
    warnings: list[str] = []
    on_cuda = case.device.startswith("cuda")
    for s in strategies:
        r: dict[str, Any] = res.setdefault(s, {})
        if s != "plain" and deadline is not None and time.perf_counter() > deadline:
            r["error"] = "skipped: the time limit of this model was reached"
            continue
        t0 = time.perf_counter()
        try:
            runner = Runner(case, s, plain_held, share, None if train_steps <= 1 else lr, compile_kw)
            for _ in range(warmup):
                runner.step(seed)
            gradient_scope.model_stats(runner.model, reset=True)
            p = runner.profiled_step(seed, probe=memory or s == "plain")
            stats = gradient_scope.model_stats(runner.model, reset=True)
            if stats.modules:  # the profiled step's scopes, summed
                r["scopes"] = {"modules": len(stats.modules), **{k: getattr(stats, k) for k in _COUNTERS}}
            losses = [p["loss"]] + [runner.train_step(seed + i) for i in range(1, train_steps)]
            r.update({k: p[k] for k in ("held", "peak") if k in p}, losses=[float(x) for x in losses])
            if runner.budget is not None:
                r.update(budget_bytes=runner.budget.bytes, planned_bytes=runner.budget.planned_bytes)
            outcome = {"grads": p["grads"], "losses": losses, "buffers": runner.buffers()}
            del p
            if s == "plain":
                plain_held = r["held"]
                # On a GPU plain's tensors wait on the host: device memory is for the others.
                ref = {k: {n: t.cpu() for n, t in v.items()} for k, v in outcome.items() if k != "losses"}
                ref["losses"] = [x.cpu() for x in losses]
            if ref is not None:
                r.update(_agreement(outcome, ref))
            del outcome
            runners[s] = runner
        except Exception as e:  # noqa: BLE001 - a failing strategy is a result, reported as such
            r["error"] = f"{type(e).__name__}: {e}"[:2000]
            r["traceback"] = traceback.format_exc(limit=8)
            log(f"  {case.name}/{s}: FAILED: {r['error'][:300]}")
            runner = None  # type: ignore[assignment]
            free_device_memory(case.device)
            if not interception_gone():
                warnings.append(f"{s}: hooks/modes left active after the error")
            continue
        log(f"  {case.name}/{s}: warm-up, memory and {train_steps} step(s) in {time.perf_counter() - t0:.1f} s")
    del ref
    if on_cuda:
        free_device_memory(case.device)
    times: dict[str, list[dict[str, float]]] = {}
    if rounds > 0:
        for runner in runners.values():  # one unmeasured step each after the profiled one
            runner.timed_step()
        times = interleaved_rounds(
            {s: functools.partial(rn.timed_step, inner) for s, rn in runners.items()}, rounds, deadline
        )
    for phase in PHASES:
        for s, summary in ratio_summary({s: [t[phase] for t in v] for s, v in times.items()}).items():
            if phase == "step":
                res[s].update(summary)
            else:
                res[s][phase] = summary
    for runner in runners.values():
        warnings.extend(runner.warnings)
    n = min((len(v) for v in times.values()), default=0)
    runners.clear()
    free_device_memory(case.device)
    return {"strategies": res, "warnings": warnings, "rounds": n}
