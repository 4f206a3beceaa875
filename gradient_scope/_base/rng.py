"""Random-number-generator state: which generator an op draws from, and forks.

Only ops tagged ``torch.Tag.nondeterministic_seeded`` pay for a snapshot (``_base.ops``). CUDA is
never initialised here: a CUDA generator is only looked up for an op that is
already running on a CUDA device.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["capture", "replay_with_state", "default_generators"]


def _op_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    try:
        return torch.get_default_device()
    except AttributeError:
        # torch < 2.9 raises here after set_default_device(None); factories then
        # default to the device of a plain empty tensor, as get_default_device says.
        return torch.empty(()).device


def default_generators() -> list[torch.Generator]:
    """The default generators a block's random ops may draw from: the CPU's, and each
    initialised CUDA device's (CUDA is not initialised here). What a steady-state run
    observes (``_record.template`` T3 [ random states observed at saves ]) and what the recorder
    captures per op (:func:`_default_generator`) are these."""
    gens = [torch.default_generator]
    if torch.cuda.is_initialized():
        gens.extend(torch.cuda.default_generators)
    return gens


def _default_generator(device: torch.device) -> torch.Generator | None:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    # Other backends (meta, mps, xpu, ...) are not captured: ops on them replay
    # with the ambient state, as with preserve_rng_state=False.
    return None


def capture(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Generator, torch.Tensor] | None:
    """Return (generator, state) for the generator a seeded op is about to use: an
    explicit one (``generator=``, or passed positionally), else the device's default."""
    gen = kwargs.get("generator")
    if gen is None:
        for a in args:
            if isinstance(a, torch.Generator):
                gen = a
                break
    if gen is None:
        gen = _default_generator(_op_device(args, kwargs))
        if gen is None:
            return None
    return gen, gen.get_state()


def replay_with_state(rng: tuple[torch.Generator, torch.Tensor], func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """Run ``func(*args, **kwargs)`` with the generator set to the captured state,
    then restore the generator's ambient state."""
    gen, state = rng
    ambient = gen.get_state()
    gen.set_state(state)
    try:
        return func(*args, **kwargs)
    finally:
        gen.set_state(ambient)
