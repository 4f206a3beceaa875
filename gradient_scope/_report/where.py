"""Where a save happens, for :func:`saved_tensors_report`: the running module, the
running op, whether the saved tensor was made during the report's block, and the
source line of the op that made it.

Two observers, both inert while dynamo traces (``torch.compiler.is_compiling()``
is a constant there, so the traced program is the one the user compiles; see
NOTES.md, "Dynamo and global module hooks"):

* :class:`ModuleStack`: global module forward pre/post hooks keeping the stack of
  running modules of one thread, named by path.
* :class:`OpTracker`: a :class:`~torch.overrides.TorchFunctionMode` noting the
  torch function being executed, its arguments, and the storages its outputs
  made (with the user's source line), so that a save can tell tensors made in
  the block from tensors that existed before it.

``torch.utils.module_tracker.ModuleTracker`` is not used for the module paths:
its ``parents`` is a set (the innermost running module cannot be told), it puts
multi-grad hooks on every module's inputs and outputs for the whole block,
names paths from each root's class name, and sees every thread.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from .._base.lines import Location, user_line
from .._base.subclass import data_tensor, data_tensors, is_wrapper
from .._base.torch_compat import storage_id

__all__ = ["ModuleStack", "OpTracker", "NO_MODULE", "Location", "op_name", "python_caller", "storage_of", "user_line"]

NO_MODULE = "(no module)"
UNKNOWN_OP = "(unknown)"
Tensor = torch.Tensor
_compiling: Callable[[], bool] = torch.compiler.is_compiling


def storage_of(t: Tensor) -> tuple[int, Any, int]:
    """(key, weak reference, bytes) of the memory ``t`` keeps alive. A wrapper subclass
    (a DTensor) is its local data: the key and weak reference of its first inner
    tensor's storage, the bytes of its inner storages (its own storage is a
    placeholder of the global size, ``_base.subclass``)."""
    data = data_tensor(t)
    try:
        storage = data.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        storage = None
    if storage is None:
        # No storage (sparse, some subclasses): the tensor's logical size, per tensor object.
        return -id(t), weakref.ref(t), data.numel() * data.element_size()
    nbytes = storage.nbytes()
    if is_wrapper(t):
        seen = {storage_id(data)}
        for d in data_tensors(t):
            if storage_id(d) not in seen:
                seen.add(storage_id(d))
                nbytes += d.untyped_storage().nbytes()
    return storage_id(data), StorageWeakRef(storage), nbytes


def _key(t: Tensor) -> int:
    try:
        return storage_id(data_tensor(t))
    except (RuntimeError, NotImplementedError, TypeError):
        return -id(t)


def op_name(func: Any) -> str:
    name = getattr(func, "__name__", None)
    if not isinstance(name, str):
        return UNKNOWN_OP
    if name == "__get__":  # a Tensor property
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", name)
    if name.startswith("__r") and name.endswith("__") and len(name) > 5:
        return name[3:-2]  # __rmul__ -> mul
    if name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__invert__"):
        return name[3:-2] + "_"  # __iadd__ -> add_
    return name.strip("_") if name.startswith("__") else name


_COMPREHENSIONS = frozenset({"<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>"})


def python_caller() -> str:
    """Names the Python code that made autograd save with no torch function running:
    ``Name.apply`` for a custom ``autograd.Function`` (its saves happen in C++
    after its forward) where ``Function.apply`` is Python code, else the innermost
    Python function outside this package (``_CheckpointFrame.save_inputs`` for the
    inputs checkpoint keeps; the caller of ``apply`` on torch >= 2.15)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module == "gradient_scope" or module.startswith("gradient_scope.")):
            code = frame.f_code
            if code.co_name not in _COMPREHENSIONS:
                if code.co_name == "apply":
                    cls = frame.f_locals.get("cls")
                    if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
                        return f"{cls.__name__}.apply"
                return getattr(code, "co_qualname", code.co_name)
        frame = frame.f_back
    return UNKNOWN_OP


def _tensors(args: Any) -> list[Tensor]:
    """Tensors among ``args`` and one level of lists/tuples in it."""
    found = []
    for a in args:
        if isinstance(a, Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, Tensor))
    return found


class OpTracker(TorchFunctionMode):
    """Notes the torch function being executed and the storages its outputs made.
    PyTorch runs a mode's handler with the mode switched off, so functions called
    *inside* a torch function (``F.multi_head_attention_forward``'s matmuls, ...)
    are not seen: the op of a save is the outermost torch function running, and
    a tensor made inside it is new unless it is one of its arguments.

    ``made`` maps the storage key of every tensor an op made during the block to
    the user's source line: a key is never that of a storage that existed before
    the block (that storage is alive from before the block to the save, so no
    new storage can take its place), and a new storage at a reused key replaces
    the entry."""

    def __init__(self) -> None:
        super().__init__()
        self.current: Any = None
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] | None = None
        self.made: dict[int, Location | None] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _compiling():
            return func(*args, **(kwargs or {}))
        outer = self.current, self.args, self.kwargs
        self.current, self.args, self.kwargs = func, args, kwargs
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.current, self.args, self.kwargs = outer
        if isinstance(out, Tensor):
            self._note(out, args, kwargs)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, Tensor):
                    self._note(o, args, kwargs)
        return out

    def _note(self, out: Tensor, args: Any, kwargs: Any) -> None:
        if (args and out is args[0]) or (kwargs and "out" in kwargs):
            return  # in place, an out= variant: no new storage
        key = _key(out)
        # A view of an argument, or an alias (detach, .data, ...), is no new storage; a
        # view of what the op made is (F.linear with a bias on 3-D input returns one).
        if (out.grad_fn is None or out._is_view()) and any(_key(a) == key for a in _tensors(args)):
            return
        self.made[key] = user_line(sys._getframe(2))

    def made_by_running_op(self, t: Tensor, key: int) -> bool:
        """Whether ``t``, saved while a torch function runs, was made by that function
        (a tensor that is not one of its arguments)."""
        if self.current is None:
            return False
        arguments = _tensors(self.args)
        if self.kwargs:
            arguments.extend(_tensors(self.kwargs.values()))
        return not any(_key(a) == key for a in arguments)


class ModuleStack:
    """The modules whose forward is running in one thread, with their paths and
    classes, kept by global forward pre/post hooks.

    Paths are relative to ``model`` when one is given, else to the outermost
    running module; that root itself shows as its class name in parentheses."""

    __slots__ = ("thread", "stack", "names", "root", "root_label", "names_fresh", "roots")

    def __init__(self, thread: int, model: nn.Module | None = None) -> None:
        self.thread = thread
        self.stack: list[tuple[nn.Module, str]] = []
        self.names: dict[int, tuple[weakref.ref[nn.Module], str]] = {}
        if model is not None:
            model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
        self.root = weakref.ref(model) if model is not None else None
        self.root_label = f"({type(model).__name__})" if model is not None else ""
        self.names_fresh = False
        self.roots: dict[int, weakref.ref[nn.Module]] = {}  # outermost modules that ran

    def current(self) -> tuple[str, str]:
        """(path, class name) of the innermost running module."""
        if not self.stack:
            return NO_MODULE, NO_MODULE
        module, label = self.stack[-1]
        return label, type(module).__name__

    def _rename(self, root: nn.Module) -> None:
        self.names = {id(m): (weakref.ref(m), name) for name, m in root.named_modules()}
        self.names_fresh = True

    def _label(self, module: nn.Module) -> str:
        root = self.root() if self.root is not None else None
        if root is None:
            if not self.stack:
                self.root_label = f"({type(module).__name__})"
                self.names = {}  # computed on the first submodule call of this root call
                self.names_fresh = False
                return self.root_label
            root = self.stack[0][0]
        elif not self.stack:
            self.names_fresh = False
        found = self.names.get(id(module))
        if (found is None or found[0]() is not module) and not self.names_fresh:
            self._rename(root)  # submodules may have changed since the last look: once per root call
            found = self.names.get(id(module))
        if found is not None and found[0]() is module:
            return found[1] or self.root_label
        # Not a submodule of the root.
        outer = self.stack[-1][1] + "." if self.stack else ""
        return f"{outer}({type(module).__name__})"

    def state_keys(self) -> set[int]:
        """Storage keys of the parameters and buffers of ``model`` and of the
        outermost modules that ran (alive anyway)."""
        keys: set[int] = set()
        refs = [*self.roots.values(), *((self.root,) if self.root is not None else ())]
        for ref in refs:
            m = ref()
            if m is not None:
                keys.update(_key(t) for t in (*m.parameters(), *m.buffers()))
        return keys

    def pre_hook(self, module: nn.Module, args: Any) -> None:
        if _compiling():
            return
        if threading.get_ident() == self.thread:
            if not self.stack:
                self.roots[id(module)] = weakref.ref(module)
            self.stack.append((module, self._label(module)))

    def post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if _compiling() or threading.get_ident() != self.thread:
            return
        stack = self.stack
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] is module:
                del stack[i:]  # also modules whose forward raised without their hook
                return
