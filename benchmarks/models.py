"""Real-model benchmark: recompute strategies on Hugging Face transformers models.

    python -m benchmarks.models [--quick] [--device cpu|cuda] [--dtype float32|bfloat16]
                                [--models gpt2 llama ...] [--rounds N] [--out DIR]

Every model (small config, random weights) is trained a few steps (forward, backward,
AdamW step) from the same seed and weights under each strategy:

* ``plain``: no recomputation;
* ``checkpoint``: torch's ``apply_activation_checkpointing`` with a non-reentrant
  ``checkpoint_wrapper`` on each layer;
* ``scope_layer``: ``gradient_scope.apply_recompute`` on each layer;
* ``scope_attn_mlp``: ``apply_recompute`` on each attention and MLP submodule;
* ``scope_layer_savemm``: ``apply_recompute(..., save=gradient_scope.save_matmuls)`` per layer;
* ``plain_again``: plain once more (A/A control).

Reported per model and strategy: memory held after forward and peak of fwd+bwd (the
validated probe of ``benchmarks/_harness/memory.py`` on CPU, allocator statistics on CUDA), the
fwd+bwd time (median of interleaved rounds, and per-round ratios vs plain and vs
checkpoint), agreement with plain (gradients after the first step, losses of every step,
buffers such as BatchNorm's running statistics after the last step). A depth sweep
compares the peak of a scope per layer with checkpoint's at 4-32 layers. See
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import importlib.util
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradient_scope

from ._harness.machine import machine_info, mark_end
from ._harness.memory import measure
from ._harness.report import finish, make_log, no_charts, resolve_device, results_dir
from ._harness.strategies import compare_tensors
from ._harness.timing import (
    frozen_gc,
    interception_gone,
    interleaved_rounds,
    ratio_summary,
    time_step,
    warn_if_interception_left,
)
from .models_report import compute_targets, make_charts, model_markdown, sweep_markdown, targets_markdown, to_markdown

__all__ = [
    "STRATEGIES",
    "DESCRIPTIONS",
    "SWEEP_STRATEGIES",
    "apply_strategy",
    "Runner",
    "prepare",
    "run_model",
    "main",
]

STRATEGIES = ["plain", "checkpoint", "scope_layer", "scope_attn_mlp", "scope_layer_savemm", "mode_layer", "plain_again"]
SCOPE_STRATEGIES = ["scope_layer", "scope_attn_mlp", "scope_layer_savemm"]
SWEEP_STRATEGIES = ["plain", "checkpoint", "scope_layer", "scope_attn_mlp"]

DESCRIPTIONS = {
    "plain": "no recomputation",
    "checkpoint": "apply_activation_checkpointing(checkpoint_wrapper, CheckpointImpl.NO_REENTRANT) per layer",
    "scope_layer": "gradient_scope.apply_recompute(model, check_fn=<layer>)",
    "scope_attn_mlp": "apply_recompute on each attention and MLP submodule (ResNet: each residual branch)",
    "scope_layer_savemm": "apply_recompute(model, check_fn=<layer>, save=gradient_scope.save_matmuls)",
    "mode_layer": "plain, each layer's forward under a do-nothing TorchDispatchMode (a dispatch-mode floor)",
    "plain_again": "plain on a second copy (A/A control: the noise floor of the ratios)",
}

# Depths of the sweep and timing/training rounds per mode.
FULL = dict(size="full", rounds=7, train_steps=3, depths=[4, 8, 16, 32])
QUICK = dict(size="quick", rounds=2, train_steps=2, depths=[2, 4, 8], models=["gpt2", "llama", "bert", "resnet"])
TINY = dict(size="tiny", rounds=1, train_steps=2, depths=[1, 2])

Batch = dict[str, torch.Tensor]


# ---------------------------------------------------------------------- strategies


def apply_strategy(
    model: nn.Module, name: str, is_layer: Callable[[nn.Module], bool], parts: list[nn.Module]
) -> nn.Module:
    """Make ``model`` (in place) run strategy ``name``; returns the model.

    ``is_layer`` picks the layers; ``parts`` are the model's own attention/MLP modules.
    """
    if name in ("plain", "plain_again"):
        return model
    if name == "checkpoint":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=is_layer,
        )
        return model
    if name == "mode_layer":
        for m in [m for m in model.modules() if is_layer(m)]:
            m.forward = functools.partial(_under_nop_mode, m.forward)  # type: ignore[method-assign]
        return model
    if name == "scope_layer":
        return gradient_scope.apply_recompute(model, check_fn=is_layer)
    if name == "scope_layer_savemm":
        return gradient_scope.apply_recompute(model, check_fn=is_layer, save=gradient_scope.save_matmuls)
    if name == "scope_attn_mlp":
        ids = {id(m) for m in parts}
        return gradient_scope.apply_recompute(model, check_fn=lambda m: id(m) in ids)
    raise ValueError(f"unknown strategy {name!r}; the strategies are {', '.join(STRATEGIES)}")


class _NopMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def _under_nop_mode(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with _NopMode():
        return forward(*args, **kwargs)


def _plain_name(name: str) -> str:
    """Parameter/buffer name without checkpoint_wrapper's extra module level."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch).loss


class Runner:
    """One strategy on its own copy of the model: profiled, trained and timed steps."""

    def __init__(self, name: str, base: nn.Module, batch: Batch, built: Any, device: str, lr: float = 1e-3) -> None:
        self.name, self.batch, self.device = name, batch, device
        self.model = copy.deepcopy(base)
        apply_strategy(self.model, name, built.is_layer, built.parts_of(self.model))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.warnings: list[str] = []

    def check_clean(self) -> None:
        """Record a warning if a saved-tensor hook or dispatch mode outlived the step."""
        warn_if_interception_left(self.name, self.warnings)

    def grads(self) -> dict[str, torch.Tensor]:
        """Copies of the gradients, by parameter name without checkpoint_wrapper's level."""
        return {_plain_name(n): p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def buffers(self) -> dict[str, torch.Tensor]:
        """Copies of all buffers (BatchNorm statistics, ...), by plain name."""
        return {_plain_name(n): b.detach().clone() for n, b in self.model.named_buffers()}

    def profiled_step(self, seed: int) -> dict[str, Any]:
        """Step 1 under the memory probe: held, peak, loss, gradients; then the optimizer step."""
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        gc.collect()
        loss, held, peak = measure(lambda: _loss(self.model, self.batch), lambda loss: loss.backward(), self.device)
        out = {"held": held, "peak": peak, "loss": loss.detach().clone(), "grads": self.grads()}
        del loss
        self.opt.step()
        self.check_clean()
        return out

    def train_step(self, seed: int) -> torch.Tensor:
        """One fwd+bwd+AdamW step from ``torch.manual_seed(seed)``; returns the loss."""
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = _loss(self.model, self.batch)
        loss.backward()
        self.opt.step()
        self.check_clean()
        return loss.detach().clone()

    def timed_step(self) -> float:
        """One fwd+bwd (no optimizer step; gradients set to None before); seconds."""
        self.model.zero_grad(set_to_none=True)
        dt = time_step(self._fwd_bwd, self.device)
        self.check_clean()
        return dt

    def _fwd_bwd(self) -> torch.Tensor:
        loss = _loss(self.model, self.batch)
        loss.backward()
        return loss


def _layer_input_bytes(model: nn.Module, batch: Batch, is_layer: Callable[[nn.Module], bool]) -> int | None:
    """Bytes of the first layer's hidden-state input (the unit of a per-layer excess)."""
    layer = next((m for m in model.modules() if is_layer(m)), None)
    if layer is None:
        return None
    seen: list[int] = []

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if not seen:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor):
                seen.append(x.numel() * x.element_size())

    h = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            _loss(model, batch)
    finally:
        h.remove()
    return seen[0] if seen else None


def prepare(name: str, size: str, device: str, dtype: torch.dtype, seed: int, **overrides: Any):
    """Build the base model, move it, warm it up (one fwd+bwd: lazy initialisation happens
    before any copy is made, so no strategy pays for it in memory)."""
    from .hf_zoo import build

    built = build(name, size, seed, **overrides)
    base = built.model.to(device=device, dtype=dtype)
    batch = {
        k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)) for k, v in built.batch.items()
    }
    torch.manual_seed(seed)
    _loss(base, batch).backward()
    base.zero_grad(set_to_none=True)
    return built, base, batch


@frozen_gc()  # the gc.collect() before each step then only sees this model's objects
def run_model(
    name: str,
    size: str,
    device: str,
    dtype: torch.dtype,
    strategies: list[str],
    rounds: int,
    train_steps: int,
    seed: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """All strategies on one model: memory, agreement with plain, interleaved timing."""
    built, base, batch = prepare(name, size, device, dtype, seed)
    res: dict[str, Any] = {
        "config": built.config,
        "layer_class": built.layer_class,
        "n_layers": sum(1 for m in base.modules() if built.is_layer(m)),
        "attn_mlp_modules": built.parts_desc,
        "n_attn_mlp_modules": len(built.part_names),
        "layer_input_bytes": _layer_input_bytes(base, batch, built.is_layer),
        "strategies": {},
        "warnings": [],
    }
    runners: dict[str, Runner] = {}
    ref: dict[str, Any] | None = None
    for s in strategies:
        t0 = time.perf_counter()
        r: dict[str, Any] = {}
        try:
            runner = Runner(s, base, batch, built, device)
            outcome = _train(runner, r, seed, train_steps)
            if s == "plain":
                ref = outcome
            if ref is not None:
                _agreement(r, outcome, ref)
            runners[s] = runner
            del outcome
        except Exception as e:  # noqa: BLE001 - a failing strategy is a result, reported as such
            r["error"] = f"{type(e).__name__}: {e}"
            r["traceback"] = traceback.format_exc(limit=8)
            log(f"  {name}/{s}: FAILED: {r['error']}")
            if not interception_gone():
                res["warnings"].append(f"{s}: hooks/modes left active after the error")
        res["strategies"][s] = r
        log(f"  {name}/{s}: memory + {train_steps} training steps in {time.perf_counter() - t0:.1f} s")
    del ref
    for runner in runners.values():  # one unmeasured step each: optimizer state, caches
        runner.timed_step()
    times = interleaved_rounds({s: rn.timed_step for s, rn in runners.items()}, rounds)
    for s, summary in ratio_summary(times).items():
        res["strategies"][s].update(summary)
    for runner in runners.values():
        res["warnings"].extend(runner.warnings)
    return res


def _train(runner: Runner, r: dict[str, Any], seed: int, train_steps: int) -> dict[str, Any]:
    """The profiled first step and the training steps; memory and losses into ``r``;
    returns the gradients, losses and buffers to compare with plain's."""
    p = runner.profiled_step(seed)
    losses = [p["loss"]] + [runner.train_step(seed + i) for i in range(1, train_steps)]
    r.update(held=p["held"], peak=p["peak"], losses=[float(x) for x in losses])
    return {"grads": p["grads"], "losses": losses, "buffers": runner.buffers()}


def _agreement(r: dict[str, Any], outcome: dict[str, Any], ref: dict[str, Any]) -> None:
    r["grads_vs_plain"] = compare_tensors(outcome["grads"], ref["grads"])
    r["losses_vs_plain"] = compare_tensors(
        {str(i): x for i, x in enumerate(outcome["losses"])},
        {str(i): x for i, x in enumerate(ref["losses"])},
    )
    r["buffers_vs_plain"] = compare_tensors(outcome["buffers"], ref["buffers"])


def _parser() -> argparse.ArgumentParser:
    from .hf_zoo import DEFAULT_MODELS, MODELS

    p = argparse.ArgumentParser(prog="python -m benchmarks.models", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="smaller models, GPT-2/Llama/BERT/ResNet, 2 rounds (~1-2 min on CPU)"
    )
    p.add_argument(
        "--size",
        choices=["full", "quick", "tiny"],
        default=None,
        help="model size (default: full, or quick with --quick); tiny is for tests",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        default=None,
        help=f"models to run (default: {' '.join(DEFAULT_MODELS)}; --quick: gpt2 llama bert resnet)",
    )
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 7, --quick 2)")
    p.add_argument("--train-steps", type=int, default=None, help="training steps compared with plain (default 3)")
    p.add_argument("--depths", type=int, nargs="+", default=None, help="depth sweep layers (default 4 8 16 32)")
    p.add_argument("--no-sweep", action="store_true", help="skip the depth sweep")
    p.add_argument(
        "--out",
        default=None,
        help="output directory (default benchmarks/results/<device>-models/, with --quick "
        "benchmarks/results/<device>-models-quick/)",
    )
    p.add_argument("--no-charts", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: on a shared machine OpenMP threads spin-wait for "
        "each other and a step can take 10x longer; 0 keeps torch's default, one per core)",
    )
    p.add_argument(
        "--cprofile",
        metavar="STRATEGY",
        choices=STRATEGIES,
        default=None,
        help="only cProfile one fwd+bwd step of each --models model under STRATEGY and write "
        "cprofile-<model>-<strategy>.md/.prof to the output directory",
    )
    return p


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Command line entry point; returns the results dict (None with ``--cprofile``)."""
    from .hf_zoo import DEFAULT_MODELS, preload
    from .models_profile import profile_step
    from .models_sweep import run_depth_sweep

    argv = sys.argv[1:] if argv is None else argv
    p = _parser()
    a = p.parse_args(argv)

    if importlib.util.find_spec("transformers") is None:
        p.error("transformers is not installed: pip install -e '.[bench]'")
    t_start = time.perf_counter()
    log = make_log(t_start)
    mode = QUICK if a.quick else FULL
    size = a.size or mode["size"]
    if size == "tiny":
        mode = {**TINY, "models": mode.get("models")}
    if a.threads:
        torch.set_num_threads(a.threads)
    device = resolve_device(a.device, p.error)
    dtype = getattr(torch, a.dtype)
    models = a.models or mode.get("models") or DEFAULT_MODELS
    rounds = a.rounds or mode["rounds"]
    train_steps = a.train_steps or mode["train_steps"]
    depths = a.depths or mode["depths"]
    dev_name = torch.device(device).type
    suffix = "-models" + ("-profile" if a.cprofile else "-quick" if a.quick or size == "tiny" else "")
    out_dir = results_dir(a.out, dev_name + suffix)

    if a.cprofile:
        preload(models)
        for name in models:
            print(profile_step(name, a.cprofile, size, device, dtype, a.seed, out_dir))
        log(f"wrote {out_dir}/cprofile-*.md")
        return None

    machine = machine_info(device, packages=("transformers",))
    log(
        f"{machine['cpu_model']}, {machine['cpu_cores']} cores, {torch.get_num_threads()} torch threads, "
        f"torch {machine['torch']}, transformers {machine['transformers']}; {device} {a.dtype}, size {size}; "
        f"load average {machine.get('load_average_at_start')}"
    )
    preload(list(dict.fromkeys([*models, "gpt2"])))
    results_models: dict[str, Any] = {}
    sweep = None
    with frozen_gc():  # one full collection for the whole run (see frozen_gc)
        for name in models:
            log(f"{name}: {len(STRATEGIES)} strategies, {train_steps} training steps, {rounds} timing rounds")
            results_models[name] = run_model(name, size, device, dtype, STRATEGIES, rounds, train_steps, a.seed, log)
            print(f"\n{name}\n{model_markdown(results_models[name])}\n", flush=True)
        if not a.no_sweep:
            sweep_size = "tiny" if size == "tiny" else "sweep"
            log(f"depth sweep: gpt2 ({sweep_size}) at {depths} layers")
            sweep = run_depth_sweep(depths, sweep_size, device, dtype, a.seed, log=log)
            print(f"\ndepth sweep\n{sweep_markdown(sweep)}\n", flush=True)
    targets = compute_targets(results_models, sweep)
    mark_end(machine)
    results: dict[str, Any] = {
        "argv": argv,
        "device": device,
        "dtype": a.dtype,
        "size": size,
        "seed": a.seed,
        "rounds": rounds,
        "train_steps": train_steps,
        "machine": machine,
        "strategies": DESCRIPTIONS,
        "models": results_models,
        "sweep": sweep,
        "targets": targets,
    }
    finish(results, out_dir, t_start, to_markdown, no_charts if a.no_charts else make_charts)
    charts = results["charts"]
    print("targets\n" + targets_markdown(targets))
    log(f"wrote {out_dir}/results.json, results.md and {len(charts)} charts")
    return results


if __name__ == "__main__":
    main()
