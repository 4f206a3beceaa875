"""Restore, straight-line: a replay program compiled once into Python code (``_restore.handles``
P1 [ only the closure runs ], P5 [ replayed outputs are checked ]).

``_restore.replay`` interprets a :class:`~.structure.Program` op by op: per op it looks up how
each argument is filled in, loops over the outputs and over the values to free. Every
record of a structure runs the same program, so a program that runs again is compiled
into one Python function, as ``torch.fx`` does for its graphs: each value is a local
variable, each op one call of its kernel with its arguments written out, each check
inline, and a ``del`` where the interpreter would free. What differs between records
of one structure is read from the record when the function runs: its op records (plain
arguments, RNG states) and its refs (the values loaded). The code does what the
interpreter does, in the same order (``tests/restore/test_replay_code.py`` runs both).

RULES C1..C3: when a replay program is compiled, and what its code depends on.

C1. [ compiled at the HOT-th run ] A program is compiled the ``HOT``-th time it runs;
    before, it is interpreted (compiling costs more than one interpretation).
C2. [ what the code depends on ] The code depends on the program, on where the record's
    numeric context changes (R9 [ each op's numeric context ] in ``_record.entry``: the
    code enters a context only where the op it applies to starts) and on ``debug=True``
    (every output compared): one function per combination, cached on the program.
C3. [ one code per source ] The source does not name sizes, dtypes or devices (the function
    reads them from its globals): records of one program that differ only in sizes (a batch
    padded to another length) write the same source, which Python compiles once
    (``_CODES``); each program binds that code to its own globals.
"""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType
from typing import Any

import torch

from .._base.errors import RecomputeError
from .._base.torch_compat import op_schema
from .structure import Program, Structure

__all__ = ["HOT", "compiled", "failed"]

Tensor = torch.Tensor
HOT = 2  # C1 [ compiled at the HOT-th run ]
#: C3 [ one code per source ]: Python's compiled code per source text (emptied when full)
_CODES: dict[str, CodeType] = {}
_CODES_KEPT = 512
#: The compiled form of a program: ``(ops, refs, cache, contexts, debug_values) -> (value, kept)``.
Code = Callable[[Any, Any, Any, Any, Any], tuple[Tensor, dict[int, Tensor]]]

_FAILED = (
    "Likely cause: something the op depends on changed between forward and backward without the "
    "block seeing it, or the op cannot run twice. Fix: keep its output with save=[...] or move it "
    "out of the recompute_scope."
)


def failed(func: Any, e: BaseException) -> RecomputeError:
    """The error for an op that raised while replayed."""
    return RecomputeError(f"gradient_scope: replaying {func} failed during backward: {e}. {_FAILED}")


def compiled(
    st: Structure, program: Program, starts: tuple[int, ...], debug: bool, runtime: dict[str, Any]
) -> Code | None:
    """The compiled form of ``program`` (C2 [ what the code depends on ]), or None while it is
    not hot yet (C1 [ compiled at the HOT-th run ]). ``runtime`` holds the interpreter's helpers
    the code calls: ``load``, ``check``, ``rng`` (``(rng, func, args, kwargs) -> out``)."""
    key = (starts, debug)
    code = program.code.get(key)
    if code is None:
        program.runs += 1
        if program.runs < HOT:
            return None
        code = program.code[key] = _compile(st, program, starts, debug, runtime)
    return code


def _compile(st: Structure, program: Program, starts: tuple[int, ...], debug: bool, runtime: dict[str, Any]) -> Code:
    lines = ["def replay(O, R, C, X, DV):", "    P = {}"]
    names: dict[str, Any] = {"T": Tensor, "RecomputeError": RecomputeError, "failed": failed, **runtime}
    for s, i in program.loads:
        names[f"F{i}"] = st.funcs[i]
        lines.append(f"    v{s} = load(R[{s}], F{i}, C)")
    lines += ["    i = -1", "    try:"]
    frees = {i: f for i, _, f in program.steps}
    context = -1
    for i, outputs, _ in program.steps:
        j = _context_at(starts, i)
        if j != context:
            lines.append(f"        X.at({i})")
            context = j
        lines += [f"        i = {i}", f"        r = O[{i}]"]
        names[f"F{i}"], names[f"K{i}"] = st.funcs[i], st.kernels[i]
        # One Tensor result that is output 0: the call binds it directly, no ``o``.
        direct = len(outputs) == 1 and outputs[0][0] == 0 and _one_tensor(st.funcs[i])
        lines.append(f"        {_name(outputs[0][1], outputs[0][2], program) if direct else 'o'} = {_call(st, i)}")
        lines += _outputs(st, i, outputs, program, debug, names, direct)
        if frees[i]:
            lines.append(f"        del {', '.join(f'v{s}' for s in frees[i])}")
    lines += [
        f"        return v{program.target}, P",
        "    except RecomputeError:",
        "        raise",
        "    except Exception as e:",
        "        raise failed(O[i].func, e) from e",
    ]
    source = "\n".join(lines) + "\n"
    code = _CODES.get(source)
    if code is None:  # C3 [ one code per source ]
        if len(_CODES) >= _CODES_KEPT:
            _CODES.clear()
        code = _CODES[source] = compile(source, f"<gradient_scope replay of {len(program.plan)} ops>", "exec")
    exec(code, names)
    return names["replay"]  # type: ignore[no-any-return]


def _context_at(starts: tuple[int, ...], i: int) -> int:
    """Which entry of the record's contexts op ``i`` runs under (as ``replay._Contexts.at``)."""
    j = 0
    while j + 1 < len(starts) and starts[j + 1] <= i:
        j += 1
    return j if starts else -1


def _call(st: Structure, i: int) -> str:
    """The expression that runs op ``i``."""
    pos: dict[int, str] = {}
    kw: dict[str, str] = {}
    for where, how in st.fills[i]:
        src = f"r.args[{where}]" if type(where) is int else f"r.kwargs[{where!r}]"
        if type(how) is int:
            value = f"v{how}"
        elif how is None:  # a MetaArg: a fresh tensor like it
            value = f"{src}.empty()"
        else:  # a Tensor[] list
            value = "[" + ", ".join(f"v{s}" if s >= 0 else f"{src}[{k}]" for k, s in enumerate(how)) + "]"
        if type(where) is int:
            pos[where] = value
        else:
            kw[where] = value
    arity, keywords, random = st.calls[i]
    args = ", ".join(pos.get(p, f"r.args[{p}]") for p in range(arity))
    kwargs = "r.kwargs" if not kw else "{**r.kwargs, " + ", ".join(f"{k!r}: {v}" for k, v in kw.items()) + "}"
    if random:
        call = f"rng(r.rng, F{i}, ({args}{',' if args else ''}), {kwargs})"
    elif keywords:
        call = f"K{i}({args}{', ' if args else ''}**{kwargs})"
    else:  # no keyword argument in any record of this structure
        call = f"K{i}({args})"
    return call


def _outputs(
    st: Structure, i: int, outputs: Any, program: Program, debug: bool, names: dict[str, Any], direct: bool
) -> list[str]:
    """Lines that bind (unless ``direct``), check (P5 [ replayed outputs are checked ]) and keep
    (P4 [ each op at most once per pass ]) op ``i``'s outputs."""
    lines = []
    for k, s, store in outputs:
        v = _name(s, store, program)
        if not direct:
            lines.append(f"        {v} = o if {k} == 0 and isinstance(o, T) else o[{k}]")
        size, dtype, device = st.meta[s]
        names[f"D{s}"], names[f"V{s}"], names[f"Z{s}"] = dtype, device, size
        if debug:
            lines.append(f"        check(F{i}, R[{s}], {v}, DV)")
        else:
            shape = "" if size is None else f" or {v}.shape != Z{s}"
            place = f"not {v}.is_cpu" if device.type == "cpu" else f"{v}.device != V{s}"  # is_cpu: no device object
            cond = f"type({v}) is not T or {v}.dtype is not D{s}{shape} or {place}"
            lines.append(f"        if {cond}: check(F{i}, R[{s}], {v}, DV)")
        if s in program.keep:
            lines.append(f"        P[{s}] = {v}")
        if v == "_v":
            lines.append("        del _v")
    if not direct:
        lines.append("        del o")
    return lines


def _name(s: int, store: bool, program: Program) -> str:
    """The local an output is bound to: its slot's, or a temporary when nothing reads it."""
    return f"v{s}" if store or s == program.target else "_v"


def _one_tensor(func: Any) -> bool:
    """Whether ``func`` returns exactly one Tensor (its result is its output 0)."""
    schema = op_schema(func)
    return schema is not None and len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"
