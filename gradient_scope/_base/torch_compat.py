"""Every private PyTorch API the library uses, in one place.

Each name below is read once, at import, so that a PyTorch without it fails
here rather than deep inside a hook; ``_base.torch_floor`` turns the oldest such
gap (2.8: ``_top_saved_tensors_default_hooks``) into an ImportError first. All
names exist in 2.8.0 through 2.15.0; ``in_compiled_code`` degrades gracefully
where its pieces are missing. Each shim names the torch source it relies on.

Outside this module, only the adapters use private APIs, of what they adapt
(FSDP2 internals in ``_adapters.fsdp``, dynamo and AOTAutograd in ``_adapters.compile.graph``), behind
their own guards. ``Tensor._version`` and ``Tensor._base``, documented in
PyTorch's autograd notes and read on the hot paths, are used directly.
``_base.torch_floor`` reads the oldest of these APIs before this module is imported,
to fail with a message that names the torch floor.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "OpOverload",
    "OpOverloadPacket",
    "TorchDispatchMode",
    "get_alias_info",
    "is_traceable_wrapper_subclass",
    "dynamo_skips",
    "neg_view",
    "node_sequence_nr",
    "storage_id",
    "storage_use_count",
    "overload_kernel",
    "op_schema",
    "op_overload_name",
    "op_qualified_name",
    "HookPair",
    "push_saved_hooks",
    "pop_saved_hooks",
    "top_saved_hooks",
    "saved_hooks_enabled",
    "saved_hooks_disabled_message",
    "current_graph_task",
    "module_hooks_reached",
    "queue_engine_callback",
    "sequence_nr",
    "below_autograd",
    "set_grad_mode",
    "without_autocast",
    "without_python_dispatch",
    "alias_in_dispatch",
    "current_dispatch_mode",
    "dispatch_stack",
    "pop_dispatch_mode",
    "push_dispatch_mode",
    "set_dispatch_stack",
    "remove_mode_from_under",
    "without_torch_function",
    "skip_dynamo",
    "import_detached",
    "suspend_dynamo_compile",
    "resume_dynamo_compile",
    "in_compiled_code",
    "is_dynamo_error",
    "is_recompile_limit",
    "global_module_hooks_active",
    "any_mode_active",
    "is_higher_order_op",
    "innermost_function_mode",
    "remove_function_mode_from_under",
    "SEEDED_TAG",
    "profiler_range",
    "set_version",
    "NumericContext",
    "numeric_context",
    "set_numeric_context",
    "default_dtype",
]

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket

from torch.utils._python_dispatch import (  # noqa: E402
    TorchDispatchMode,
    get_alias_info,
    is_traceable_wrapper_subclass,
)

# ---------------------------------------------------------------- saved-tensor hooks
# The thread-local stack of default (pack, unpack) pairs behind
# ``torch.autograd.graph.saved_tensors_hooks``. All since 1.x except ``_top``
# (2.8+).

_A = torch._C._autograd
HookPair = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]

push_saved_hooks: Callable[[Any, Any], None] = _A._push_saved_tensors_default_hooks
#: PyTorch's own pop, captured at import: ``_save.interception`` may temporarily
#: replace the module attribute, never this reference.
pop_saved_hooks: Callable[[], None] = _A._pop_saved_tensors_default_hooks
_top: Callable[[bool], Any] = _A._top_saved_tensors_default_hooks
saved_hooks_enabled: Callable[[], bool] = _A._saved_tensors_hooks_is_enabled  # type: ignore[attr-defined]
saved_hooks_disabled_message: Callable[[], str | None] = _A._saved_tensors_hooks_get_disabled_error_message


def top_saved_hooks() -> HookPair | None:
    """The innermost (pack, unpack) pair of this thread, or None."""
    return _top(False)  # type: ignore[no-any-return]


def pop_attribute_owner() -> Any:
    """The module object whose ``_pop_saved_tensors_default_hooks`` attribute
    ``saved_tensors_hooks.__exit__`` looks up at call time (and whose
    ``_saved_tensors_hooks_disable`` ``disable_saved_tensors_hooks`` does)."""
    return _A


# ---------------------------------------------------------------- autograd engine

current_graph_task: Callable[[], int] = torch._C._current_graph_task_id  # -1 outside backward
_engine = torch.autograd.Variable._execution_engine


def queue_engine_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass ends (inside the engine)."""
    _engine.queue_callback(fn)


#: The sequence number the next autograd node of this thread will get.
sequence_nr: Callable[[], int] = _A._get_sequence_nr

# ---------------------------------------------------------------- dispatch

#: A guard under which ops run below autograd: no graph is built, whatever the grad mode.
below_autograd = torch._C._AutoDispatchBelowAutograd

#: Set grad mode (what ``torch.set_grad_enabled`` does, without making a context object).
set_grad_mode: Callable[[bool], None] = torch._C._set_grad_enabled

_autocast = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
for _name in ("AutocastCUDA", "AutocastXPU", "AutocastMPS", "AutocastHPU", "AutocastPrivateUse1"):
    if hasattr(torch._C.DispatchKey, _name):
        _autocast = _autocast | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _name))
_AUTOCAST_KEYS = _autocast


def without_autocast() -> Any:
    """A guard under which autocast does not cast (records are already cast)."""
    return torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS)


#: A guard that skips Python dispatch (modes and subclasses) for plain tensors.
without_python_dispatch = torch._C._DisableTorchDispatch

_INPLACE_OR_VIEW = torch._C.DispatchKey.ADInplaceOrView
_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded


def alias_in_dispatch(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()`` sharing ``t``'s version counter, also inside ``__torch_dispatch__``
    (where the ADInplaceOrView key, which makes detach share it, is excluded)."""
    if _is_excluded(_INPLACE_OR_VIEW):
        _set_excluded(_INPLACE_OR_VIEW, False)
        try:
            return t.detach()
        finally:
            _set_excluded(_INPLACE_OR_VIEW, True)
    return t.detach()


from torch.utils._python_dispatch import _get_current_dispatch_mode  # noqa: E402

current_dispatch_mode: Callable[[], Any] = _get_current_dispatch_mode


def dispatch_stack() -> list[Any]:
    """Pop and return this thread's whole TorchDispatchMode stack, innermost last."""
    modes = []
    while torch._C._len_torch_dispatch_stack() > 0:
        modes.append(torch._C._pop_torch_dispatch_stack(None))
    modes.reverse()
    return modes


def pop_dispatch_mode() -> Any:
    """Pop this thread's innermost TorchDispatchMode off the stack (its Python flags
    stay as they are, as ``torch.utils._python_dispatch._pop_mode_temporarily`` leaves
    them); :func:`push_dispatch_mode` puts it back."""
    return torch._C._pop_torch_dispatch_stack(None)


push_dispatch_mode: Callable[[Any], None] = torch._C._push_on_torch_dispatch_stack


def set_dispatch_stack(modes: list[Any]) -> None:
    """Push ``modes`` (innermost last) onto this thread's empty mode stack."""
    for mode in modes:
        torch._C._push_on_torch_dispatch_stack(mode)


# The Python-level flags a TorchDispatchMode saves on entry and restores on exit
# (the last two exist from 2.9 on).
_MODE_FLAGS = (
    ("old_dispatch_mode_flags", "_is_in_torch_dispatch_mode"),
    ("old_non_infra_dispatch_mode_flags", "_is_in_non_infra_torch_dispatch_mode"),
    (
        "old_without_ignore_compile_internals_dispatch_mode_flags",
        "_is_in_any_mode_without_ignore_compile_internals",
    ),
)


def remove_mode_from_under(mode: Any) -> None:
    """Take ``mode`` out of this thread's mode stack while modes entered after it
    are still active. Those stay; their saved flags are rewritten as if ``mode``
    had never been entered, so that when they exit, the flags are as before ``mode``."""
    import torch.utils._python_dispatch as pd

    stack = dispatch_stack()
    at = next(i for i, m in enumerate(stack) if m is mode)
    above = stack[at + 1 :]
    set_dispatch_stack(stack[:at] + above)
    flags = [getattr(mode, deque_name)[-1] for deque_name, _ in _MODE_FLAGS if getattr(mode, deque_name, None)]
    for deque_name, _ in _MODE_FLAGS:
        if getattr(mode, deque_name, None):
            getattr(mode, deque_name).pop()
    if len(flags) != len(_MODE_FLAGS) or not hasattr(pd, _MODE_FLAGS[2][1]):
        return  # an older torch: fewer flags, nothing consistent to rewrite
    for m in above:
        for (deque_name, _), value in zip(_MODE_FLAGS, flags):
            saved = getattr(m, deque_name, None)
            if saved:
                saved[-1] = value
        flags = [True, flags[1] or not m.is_infra_mode(), flags[2] or not m.ignore_compile_internals()]
    for (_, global_name), value in zip(_MODE_FLAGS, flags):
        setattr(pd, global_name, value)
    getattr(pd, "set_is_in_mode_without_ignore_compile_internals")(flags[2])  # noqa: B009


def import_detached(name: str) -> Any:
    """``importlib.import_module(name)``, run in a thread of its own the first time.

    An import can leave reference cycles that hold its frames (a module that keeps a
    caught exception), and a frame holds its caller: imported from a scope's entry,
    they would keep the user's frame, and its tensors, alive until the garbage
    collector runs. In a fresh thread the only callers are that thread's."""
    if name in sys.modules:
        return importlib.import_module(name)
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(importlib.import_module(name))
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            box.append(e)

    worker = threading.Thread(target=run, name=f"gradient_scope: import {name}", daemon=True)
    worker.start()
    worker.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def skip_dynamo(code: Any) -> None:
    """Tell dynamo never to trace ``code`` nor anything it calls (what
    ``torch._dynamo.disable(fn, recursive=True)`` does, without a wrapper call per
    use). Relies on ``set_code_exec_strategy``, ``FrameAction`` and
    ``FrameExecStrategy`` of ``torch/_dynamo/eval_frame.py`` (2.6+; the floor is 2.8)."""
    ef = import_detached("torch._dynamo.eval_frame")
    skip = getattr(ef, "FrameAction").SKIP  # noqa: B009  (not re-exported: getattr)
    getattr(ef, "set_code_exec_strategy")(code, getattr(ef, "FrameExecStrategy")(skip, skip))  # noqa: B009


_set_eval_frame: Callable[[Any], Any] | None = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "set_eval_frame", None
)


def suspend_dynamo_compile() -> Any:
    """Stop dynamo from compiling (or running compiled code for) the frames this
    thread enters from now on, as ``torch._dynamo.disable`` does; functions wrapped
    by ``torch.compile`` still compile (their wrapper sets its own callback). Returns
    the callback to give :func:`resume_dynamo_compile`, None when none was set."""
    if _set_eval_frame is None:
        return None
    return _set_eval_frame(None)


def resume_dynamo_compile(prior: Any) -> None:
    """Undo :func:`suspend_dynamo_compile` (``prior`` is what it returned)."""
    if prior is not None and _set_eval_frame is not None:
        _set_eval_frame(prior)


_AOT_DIR = os.path.join(os.path.dirname(torch.__file__), "_functorch", "_aot_autograd") + os.sep
_AOT_RUNTIME = "torch._functorch._aot_autograd.runtime_wrappers"
# By file name: a code object kept here would keep dynamo's cache entries alive.
_is_aot_code: dict[str, bool] = {}


def in_compiled_code() -> bool:
    """True when the op being dispatched is run by a compiled artifact: AOTAutograd's
    runtime (``torch/_functorch/_aot_autograd/``, any AOTAutograd backend) is on the
    Python stack. Compiled forward graphs always run with grad disabled, so callers
    ask this only then; before anything was compiled it is False at once."""
    if _AOT_RUNTIME not in sys.modules:
        return False
    f: Any = sys._getframe(1)
    for _ in range(256):
        if f is None:
            break
        name = f.f_code.co_filename
        hit = _is_aot_code.get(name)
        if hit is None:
            if len(_is_aot_code) > 4096:  # files of graphs long gone: start afresh
                _is_aot_code.clear()
            hit = _is_aot_code[name] = name.startswith(_AOT_DIR)
        if hit:
            return True
        f = f.f_back
    return False


def is_recompile_limit(e: BaseException) -> bool:
    """Whether ``e`` is dynamo's refusal to compile a function again past its recompile limit."""
    exc = sys.modules.get("torch._dynamo.exc")
    return exc is not None and isinstance(e, exc.FailOnRecompileLimitHit)


def is_dynamo_error(e: BaseException) -> bool:
    """Whether ``e`` is dynamo's own failure to capture a function (a graph break under
    ``fullgraph=True``, a recompile limit, a backend error), raised before the function
    ran (``torch/_dynamo/exc.py``)."""
    exc = sys.modules.get("torch._dynamo.exc")
    if exc is None:
        return False
    return isinstance(e, (exc.TorchDynamoException, exc.FailOnRecompileLimitHit))


# code -> whether dynamo skips it (weak keys: a code object kept here would keep its function's
# dynamo cache entries alive)
_skipped: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def dynamo_skips(fn: Callable[..., Any]) -> bool:
    """Whether dynamo, asked to compile the frame of function ``fn``, would skip it and run it
    eagerly: code in its skip files (``torch.nn``'s own modules, such as ``nn.Sequential.forward``;
    it inlines them only when called from traced code). Relies on
    ``torch._dynamo.trace_rules.check`` (``is_inlined_call=False``: a frame dynamo is handed)."""
    code = fn.__code__
    hit = _skipped.get(code)
    if hit is None:
        hit = _skipped[code] = bool(import_detached("torch._dynamo.trace_rules").check(code))
    return bool(hit)


_module_hooks = torch.nn.modules.module


def any_mode_active() -> bool:
    """Whether a TorchDispatchMode or a TorchFunctionMode is active in this thread."""
    return bool(torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack())


def is_higher_order_op(target: Any) -> bool:
    """Whether an FX node's target is a higher-order operator (``torch._ops.HigherOrderOperator``)."""
    return isinstance(target, torch._ops.HigherOrderOperator)


def global_module_hooks_active() -> bool:
    """Whether a global module hook is registered (``register_module_forward_hook`` and
    friends): dynamo breaks the graph at each module call under one."""
    m = _module_hooks
    return bool(
        m._global_forward_pre_hooks
        or m._global_forward_hooks
        or m._global_backward_pre_hooks
        or m._global_backward_hooks
    )


_Module = torch.nn.Module
_CALLS = (_Module.__call__, _Module._call_impl, _Module._wrapped_call_impl)


def _hooked(m: torch.nn.Module, itself: bool) -> bool:
    # every steady call walks its module's tree: ``_modules`` directly, not ``modules()``
    # (which builds a name per submodule)
    seen = {id(m)}
    todo = [m]
    while todo:
        sub = todo.pop()
        if (itself or sub is not m) and (
            sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or sub._backward_pre_hooks
        ):
            return True
        for child in sub._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                todo.append(child)
    return False


def module_hooks_reached(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a module ``fn`` reaches directly has a hook (forward, forward pre-, backward or
    backward pre-), on itself or a submodule: a bound method's module (its own hooks only
    when the method is the module's ``__call__``: they run around ``forward``, outside it),
    modules in ``fn``'s closure, defaults and globals it names, and among its arguments
    (also one level into lists, tuples and dicts)."""
    func = getattr(fn, "__func__", None)
    if func is not None:
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, _Module) and _hooked(owner, func in _CALLS):
            return True
        fn = func
    found: list[Any] = [*args, *kwargs.values()]
    cells = getattr(fn, "__closure__", None)
    if cells:
        for c in cells:
            with contextlib.suppress(ValueError):  # an empty cell
                found.append(c.cell_contents)
    found.extend(getattr(fn, "__defaults__", None) or ())
    found.extend((getattr(fn, "__kwdefaults__", None) or {}).values())
    code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is not None and names is not None:
        found.extend(names[n] for n in code.co_names if n in names)
    for v in found:
        if isinstance(v, (list, tuple)):
            inner: Any = v
        elif isinstance(v, dict):
            inner = v.values()
        else:
            inner = (v,)
        for m in inner:
            if isinstance(m, _Module) and _hooked(m, True):
                return True
    return False


#: A guard under which no TorchFunctionMode sees the calls made.
without_torch_function = torch._C.DisableTorchFunction


def innermost_function_mode() -> Any:
    """The innermost TorchFunctionMode of this thread, or None."""
    n = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(n - 1) if n else None


def remove_function_mode_from_under(mode: Any) -> None:
    """Take ``mode`` out of this thread's TorchFunctionMode stack, leaving the
    modes entered after it in place."""
    above = []
    while torch._C._len_torch_function_stack():
        m = torch._C._pop_torch_function_stack()
        if m is mode:
            break
        above.append(m)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


SEEDED_TAG = torch.Tag.nondeterministic_seeded

# ---------------------------------------------------------------- tensors, nodes, ops

#: ``torch._neg_view(t)``: ``t`` with its negative bit set (native_functions.yaml: ``_neg_view``).
neg_view: Callable[[torch.Tensor], torch.Tensor] = torch._neg_view


def node_sequence_nr(node: Any) -> int:
    """The sequence number of autograd node ``node`` (``torch/autograd/graph.py``:
    ``Node._sequence_nr``)."""
    return node._sequence_nr()  # type: ignore[no-any-return]


def storage_id(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage: the address of its StorageImpl, the same
    for every Python object of it (``torch/storage.py``: ``_cdata``)."""
    return t.untyped_storage()._cdata  # type: ignore[no-any-return]


_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def storage_use_count(storage: torch.UntypedStorage) -> int | None:
    """How many references ``storage``'s StorageImpl has (each tensor over it holds one,
    each Python storage object one): ``torch/csrc/Module.cpp``, ``_storage_Use_Count``.
    None where this torch lacks it."""
    if _use_count is None:
        return None
    return _use_count(storage._cdata)


def overload_kernel(func: Any) -> Any:
    """The C++ callable behind an ``OpOverload`` (``torch/_ops.py``: ``OpOverload._op``;
    calling it skips ``OpOverload.__call__``'s Python frame)."""
    return func._op


def op_schema(op: Any) -> Any:
    """The ``FunctionSchema`` of an ``OpOverload`` (``torch/_ops.py``: ``OpOverload._schema``),
    or None for anything else."""
    return getattr(op, "_schema", None)


def op_overload_name(op: Any) -> str:
    """The overload name of an ``OpOverload`` (``torch/_ops.py``: ``OpOverload._overloadname``)."""
    return op._overloadname  # type: ignore[no-any-return]


def op_qualified_name(op: Any) -> Any:
    """``"namespace::name"`` of an ``OpOverloadPacket`` (``torch/_ops.py``:
    ``OpOverloadPacket._qualified_op_name``), or None for anything else."""
    return getattr(op, "_qualified_op_name", None)


# ---------------------------------------------------------------- profiler
# A named range in profiler traces that dispatches no op (a block's recorder must not
# see it): torch/csrc/profiler/python/init.cpp, RecordFunctionFast (torch >= 2.2).
_profiler_enabled: Callable[[], bool] = torch._C._autograd._profiler_enabled
_RecordFunctionFast = torch._C._profiler._RecordFunctionFast


def profiler_range(name: str) -> Any:
    """A context manager marking ``name`` in profiler traces while a profiler
    runs; otherwise a no-op (one flag read)."""
    return _RecordFunctionFast(name) if _profiler_enabled() else contextlib.nullcontext()


def set_version(t: torch.Tensor, version: int) -> None:
    """Set the value of ``t``'s version counter, shared with its aliases
    (``torch/autograd/grad_mode.py``: ``_unsafe_preserve_version_counter`` uses it)."""
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))


# ---------------------------------------------------------------- numeric context
# Global flags an op's result depends on: which kernel runs (oneDNN, cuDNN), at
# which precision (TF32, float32 matmul precision, reduced-precision reductions),
# whether it is deterministic, and the default dtype that type promotion of
# Python scalars reads. Replay runs each op under the flags it ran under.

_C = torch._C


def _flag(name: str) -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    get, set_ = getattr(_C, f"_get_{name}", None), getattr(_C, f"_set_{name}", None)
    return None if get is None or set_ is None else (get, set_)


def _legacy(name: str) -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    """A flag of the legacy precision API: its getter raises once the new
    ``fp32_precision`` API was used alongside it (then None: the new API's values,
    also in the context, say it all)."""
    pair = _flag(name)
    if pair is None:
        return None
    get, set_ = pair

    def get_or_none() -> Any:
        try:
            return get()
        except RuntimeError:
            return None

    def set_unless_none(v: Any) -> None:
        if v is not None:
            set_(v)

    return get_or_none, set_unless_none


def _fp32(backend: str, op: str) -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    get, set_ = getattr(_C, "_get_fp32_precision_getter", None), getattr(_C, "_set_fp32_precision_setter", None)
    if get is None or set_ is None:
        return None
    try:
        get(backend, op)
    except RuntimeError:
        return None
    return functools.partial(get, backend, op), functools.partial(set_, backend, op)


def _deterministic() -> tuple[bool, bool]:
    return _C._get_deterministic_algorithms(), _C._get_deterministic_algorithms_warn_only()


def _set_deterministic(v: tuple[bool, bool]) -> None:
    _C._set_deterministic_algorithms(v[0], warn_only=v[1])


# (getter, setter) pairs, set in this order: a later flag may be derived from an
# earlier one (``set_float32_matmul_precision`` sets the fp32 precisions below it).
_CONTEXT: list[tuple[Callable[[], Any], Callable[[Any], None]]] = [
    p
    for p in (
        (_C.get_default_dtype, _C._set_default_dtype),
        (_deterministic, _set_deterministic),
        *(
            _flag(n)
            for n in (
                "mkldnn_enabled",
                "mkldnn_deterministic",
                "cudnn_enabled",
                "cudnn_deterministic",
                "cudnn_benchmark",
                "deterministic_fill_uninitialized_memory",
                "cpu_allow_fp16_reduced_precision_reduction",
                "cublas_allow_fp16_reduced_precision_reduction",
                "cublas_allow_bf16_reduced_precision_reduction",
                "cublas_allow_fp16_accumulation",
            )
        ),
        *(_legacy(n) for n in ("float32_matmul_precision", "cublas_allow_tf32", "cudnn_allow_tf32")),
        *(_fp32(b, o) for b, o in (("generic", "all"), ("mkldnn", "all"), ("cuda", "all"))),
        *(_fp32(b, o) for b in ("mkldnn", "cuda") for o in ("matmul", "conv", "rnn")),
    )
    if p is not None
]
_CONTEXT_GETTERS = tuple(g for g, _ in _CONTEXT)

#: The numeric context: one value per flag of ``_CONTEXT``; index 0 is the default dtype.
NumericContext = tuple[Any, ...]


def numeric_context() -> NumericContext:
    """The current value of every global flag an op's result may depend on."""
    return tuple([g() for g in _CONTEXT_GETTERS])


def set_numeric_context(ctx: NumericContext) -> None:
    """Set the flags of ``ctx`` that differ from the current ones."""
    for _ in range(2):  # derived flags: a second pass settles what the first changed
        for (get, set_), want in zip(_CONTEXT, ctx):
            if get() != want:
                set_(want)
        if numeric_context() == ctx:
            return


#: The default dtype (what type promotion of a Python float reads).
default_dtype: Callable[[], torch.dtype] = _C.get_default_dtype
