"""Replay: recompute the value a handle stands for from its block's record.

Each block that has handles gets one :class:`ReplayState` (made with the block,
held by its handles and by its live tensors' registry entries, so that it and
the record die as soon as backward no longer needs the block). Rules (cited
as P1..P6):

P1. Only the recorded ops in the dependency closure of the requested value
    run, in recorded order, below autograd (no graph is built) with grad mode
    on, as in forward (some kernels, e.g. ``mkldnn_rnn_layer``, return fewer
    outputs under no_grad), and with autocast off: the record is already below
    autocast, so it holds the casts forward made. Random ops run with the generator state they had in
    forward, inside a fork that restores the ambient state.
P2. A handle stands for its tensor as autograd saved it: the state of the
    tensor's storage group after every write the block recorded whose version
    is the saved one. (A kernel may save an argument before writing to it
    without bumping its version, as ``rrelu_with_noise`` does with its noise:
    that write is part of the saved value.) A recorded write that did bump the
    version after the save raises PyTorch's own in-place error, as PyTorch does.
P3. A value still in memory is used as it is: the tensor itself while it
    lives, or an alias another block holds of it (R5 in ``_entry``).
P4. Within one backward pass each op runs at most once: values that other
    pending handles of the block will ask for (their own values, and the values
    their replays will read) are cached, each entry held by at least one
    pending handle; the cache is dropped when no pending handle is left or the
    pass ends.
P5. Every replayed output is checked against forward's shape, dtype and device
    (and values with ``debug=True``); a mismatch raises :class:`RecomputeError`.
P6. An outside tensor the block read must be unchanged: same version and same
    storage. A freed storage is handed to the registered freed-storage
    handlers (FSDP2 re-gathers its parameters) before it is an error.
P7. A closed block's record (its ops and the aliases of its inputs) lives only
    as long as one of its handles: when autograd has released the last one,
    backward needs the block no more and the record is released, also while
    some of the block's tensors live on (a key/value cache). Such a tensor,
    saved after that, is stored.
P8. A storage group with members of separate version counters (``unsafe_chunk``
    pieces) that outlive the block can change without the saved tensor's version
    changing: later saves of it are stored, and a handle made earlier checks
    those members before a replay.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch
from torch.autograd.function import BackwardCFunction

from . import _recorder
from ._errors import RecomputeError
from ._plan import Derived, Ref, closure, run_plan
from ._record import BlockRecord, Input, Var, moved
from ._registry import _LIVE, Entry, tensor_of, value_in_memory
from ._torch_compat import below_autograd, current_graph_task, queue_engine_callback, sequence_nr

__all__ = [
    "Handle",
    "ViewSpec",
    "ReplayState",
    "materialize",
    "add_freed_storage_handler",
    "inplace_error",
    "may_be_new_output",
]

Tensor = torch.Tensor


def inplace_error(what: str, saved: int, now: int) -> RuntimeError:
    """PyTorch's error for a saved tensor modified in place (hooks switch its own check off)."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{what}] is at version {now}; expected version {saved} instead. "
        "(Checked by gradient_scope, which stands in for PyTorch's own check while its "
        "saved-tensor hooks are active.)"
    )


class ViewSpec:
    """A view of a block tensor taken after the block, rebuilt on the replayed base
    from its storage layout, dtype and conj/neg bits (``as_strided`` alone would
    lose the bits and cannot change the dtype)."""

    __slots__ = ("dtype", "size", "stride", "delta", "conj", "neg")

    def __init__(self, view: Tensor, base: Tensor) -> None:
        self.dtype = view.dtype
        self.size = view.size()
        self.stride = view.stride()
        # Offset from the base's first element, in bytes (dtypes may differ).
        self.delta = view.storage_offset() * view.element_size() - base.storage_offset() * base.element_size()
        self.conj = view.is_conj()
        self.neg = view.is_neg()

    @staticmethod
    def of(view: Tensor, base: Tensor) -> ViewSpec | None:
        """The spec of ``view`` (a view of ``base``), or None if it cannot be rebuilt."""
        if type(view) is not Tensor or view.layout != torch.strided or base.layout != torch.strided:
            return None
        return ViewSpec(view, base)

    def apply(self, base: Tensor) -> Tensor:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        offset = (base.storage_offset() * base.element_size() + self.delta) // itemsize
        v = torch.empty(0, dtype=self.dtype, device=base.device)
        v.set_(base.untyped_storage(), offset, self.size, self.stride)
        if self.conj:
            v = v.conj()
        if self.neg:
            v = torch._neg_view(v)
        return v


class Handle:
    """Stands in for a block tensor that autograd saved."""

    __slots__ = ("state", "entry", "var", "version", "view", "check", "itself", "__weakref__")

    def __init__(
        self,
        state: ReplayState,
        entry: Entry,
        var: Var,
        version: int,
        view: ViewSpec | None,
        check: Tensor | None,
        itself: bool,
    ) -> None:
        self.state = state
        self.entry = entry  # the registry entry of the tensor (or of the view's base)
        self.var = var
        self.version = version  # of the tensor when autograd saved it
        self.view = view
        self.check = check  # debug=True: an alias of the saved tensor, compared at unpack
        # Whether autograd would keep the tensor itself (a saved input, not a view of a
        # block tensor): then it sees a storage swap after the save (`.data = ...`);
        # otherwise it keeps the data of the save.
        self.itself = itself

    def unpack(self) -> Tensor:
        return materialize(self)

    def __del__(self) -> None:
        # Autograd released this saved tensor (P7). At interpreter shutdown the
        # slots may already be cleared.
        state = getattr(self, "state", None)
        if state is not None:
            state.dropped(id(self))


_freed_storage_handlers: list[Callable[[Tensor], bool]] = []


def add_freed_storage_handler(fn: Callable[[Tensor], bool]) -> None:
    """Register ``fn(tensor) -> bool``, asked (in order) to bring back the freed
    storage of an outside tensor a replay is about to read; True if it did."""
    _freed_storage_handlers.append(fn)


def may_be_new_output(t: Tensor) -> bool:
    """Whether ``t``, being saved, may be an output of the autograd node saving it.
    Autograd keeps a saved input itself (so it sees a later ``.data = ...``) and a
    saved output as a shallow copy (holding it would be a reference cycle through
    its own node); whoever keeps a saved tensor for autograd does the same, and
    takes a shallow copy whenever this says "may be". Exact for leaves (never an
    output) and for built-in ops (each node's saves are packed after the node is
    made and before the next one is); a custom Function's saves are packed after
    its forward, which may have made other nodes, so any custom Function output
    may be one."""
    g = t.grad_fn
    if g is None:
        return False
    return g._sequence_nr() == sequence_nr() - 1 or isinstance(g, BackwardCFunction)


def materialize(h: Handle) -> Tensor:
    """The value ``h`` stands for (P3, else a replay), as autograd saved it. With
    ``debug=True`` it is always replayed, then compared with the saved tensor."""
    t = h.entry()
    if t is not None and t._version != h.version:
        raise inplace_error(f"{t.type()} {list(t.shape)}", h.version, t._version)
    t = value_in_memory(h.entry, h.version) if h.check is None else None
    if t is not None and not h.itself and moved(h.var, t):
        t = None  # swapped after the save: autograd would hand back the data of the save
    if t is not None:
        h.state.served(h)
        with _recorder.paused():
            value = t.detach()
    else:
        value = h.state.replay(h)
    if h.view is not None:
        with _recorder.paused(), below_autograd():
            value = h.view.apply(value)
    if h.check is not None and not _same(value, h.check):
        raise RecomputeError(
            f"gradient_scope (debug): the recomputed {h.var.describe()} differs from the "
            "tensor autograd saved, whose version did not change: it was written through "
            "`.data`, a NumPy array (torch.from_numpy) or untyped_storage() after it was "
            "saved, or a tensor the block read was. Do not write to tensors a block made or "
            "read until backward has run."
        )
    return value


def _same(a: Tensor, b: Tensor) -> bool:
    if a.device.type == "cpu":
        return bool(torch.equal(a, b))
    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-8, equal_nan=True))


def _live(var: Var) -> Tensor | None:
    """The tensor ``var`` stands for, if alive and unchanged (an inference tensor,
    which has no version counter, is recomputed instead)."""
    if _LIVE.get(var.key) is var:
        t: Tensor | None = var()
        if t is not None and not t.is_inference() and t._version == var.version and not moved(var, t):
            return t
    return None


class _Pass:
    """Replay state of one block within one backward pass (P4). Pending handles are
    held weakly; a handle that dies unserved releases what it held (``dropped``)."""

    __slots__ = ("task", "cache", "refs", "holds", "pending")

    def __init__(self, task: int, pending: dict[int, weakref.ref[Handle]]) -> None:
        self.task = task
        # Values keyed by (var, number of its group's writes applied).
        self.cache: dict[tuple[Var, int], Tensor] = {}
        self.refs: dict[tuple[Var, int], int] = {}  # holders of each entry
        # id(handle) -> the keys it holds; an id leaves before its handle dies.
        self.holds: dict[int, list[tuple[Var, int]]] = {}
        self.pending = dict(pending)  # id(handle) -> handle, not served in this pass yet

    def hold(self, h: Handle, key: tuple[Var, int], value: Tensor) -> None:
        self.cache[key] = value
        self.holds.setdefault(id(h), []).append(key)
        self.refs[key] = self.refs.get(key, 0) + 1

    def serve(self, h: Handle) -> None:
        self.pending.pop(id(h), None)
        self.release(id(h))

    def release(self, hid: int) -> None:
        for key in self.holds.pop(hid, ()):
            n = self.refs[key] - 1
            if n:
                self.refs[key] = n
            else:
                del self.refs[key]
                self.cache.pop(key, None)


def _wanted(
    derived: Derived, record: BlockRecord, refs: list[tuple[Ref, ...]], ps: _Pass, h: Handle, plan: set[int]
) -> tuple[dict[Var, list[Handle]], dict[Var, list[Handle]]]:
    """What the other pending handles will ask for that this plan makes: their
    own values (targets), and values their own replays would read (frontier)."""
    targets: dict[Var, list[Handle]] = {}
    frontier: dict[Var, list[Handle]] = {}
    for ref in list(ps.pending.values()):
        h2 = ref()
        if h2 is None or h2 is h:
            continue
        n2 = h2.var
        if (n2, len(n2.root.writes)) in ps.cache or value_in_memory(h2.entry, h2.version) is not None:
            continue
        if n2.op in plan:
            targets.setdefault(n2, []).append(h2)
            continue
        for i, r in derived.reads_of(record, refs, n2):
            if r.op in plan and i not in plan:
                frontier.setdefault(r, []).append(h2)
    return targets, frontier


class ReplayState:
    """Replay bookkeeping of one block: its pending handles, the current pass's
    cache, what replay derives from its record. Only this class writes them, under
    ``lock``."""

    __slots__ = ("record", "lock", "pending", "handles", "current", "derived", "__weakref__")

    def __init__(self, record: BlockRecord) -> None:
        self.record: BlockRecord | None = record  # None once released (P7)
        self.lock = threading.RLock()  # backward may run in another thread
        self.pending: dict[int, weakref.ref[Handle]] = {}  # live handles, by id
        self.handles = 0  # live handles
        self.current: _Pass | None = None
        self.derived = Derived()  # what replay derives from the record, once closed

    def handle(self, entry: Entry, t: Tensor, view: ViewSpec | None) -> Handle | None:
        """A handle for ``t`` (a block tensor, or ``view`` of one), or None to store it."""
        var: Var = entry  # type: ignore[assignment]
        root = var.root
        if isinstance(root, Input):
            return None  # a view of an outside tensor: storing it costs nothing extra
        record = self.record
        if record is None:
            return None  # released (P7): the block cannot be replayed any more
        if root in record.escaped:
            return None  # another member may be written after the block unseen (P8)
        base = t if view is None else t._base
        if base is not None and moved(var, base):
            return None  # its data was swapped after the block (`.data = ...`)
        v = t._version
        writes = root.writes
        if v != (writes[-1][1] if writes else var.version):
            return None  # changed by something the block did not record (e.g. after it)
        new_output = may_be_new_output(t)
        # debug=True compares the value at unpack with what autograd itself would hand back.
        check = None
        if var.frame.debug and var not in record.scratch:
            check = t.detach() if new_output else t
        h = Handle(self, entry, var, v, view, check, view is None and not new_output)
        with self.lock:
            self.pending[id(h)] = weakref.ref(h)
            self.handles += 1
        stats = var.frame.stats
        stats.tensors_packed += 1
        stats.bytes_packed += t.numel() * t.element_size()
        return h

    def replay(self, h: Handle) -> Tensor:
        """Recompute ``h``'s value (P1, P2, P4)."""
        var = h.var
        for _, post in var.root.writes:
            if post is None:
                raise RecomputeError(
                    f"gradient_scope: cannot recompute a {var.describe()}: the block wrote to it "
                    "with an op that is never replayed (a collective). Keep it out of the "
                    "recompute_scope or store it with save=[...]."
                )
            if post > h.version:
                raise inplace_error(var.describe(), h.version, post)
        record = self.record
        if record is None:  # P7: a live handle keeps its record
            raise RecomputeError(
                "gradient_scope: internal error: a block record was released early. Please report this."
            )
        root = var.root
        escaped = record.escaped.get(root, {}) if isinstance(root, Var) else {}
        for member, version in escaped.items():  # P8
            t = tensor_of(member)
            if member is not var and (t is None or t._version != version):
                raise RecomputeError(
                    f"gradient_scope: cannot recompute a {var.describe()}: a tensor sharing its "
                    "storage with a version counter of its own (an unsafe_split / unsafe_chunk "
                    "piece) outlived the block and may have been written since. Keep such "
                    "pieces inside the block, or the tensor out of the recompute_scope."
                )
        with self.lock:
            task = current_graph_task()
            ps = self._pass(task) if task != -1 else None
            key = (var, len(var.root.writes))
            if ps is not None:
                cached = ps.cache.get(key)
                if cached is not None:
                    self._served(ps, h)
                    return cached
            cache = ps.cache if ps is not None else {}

            def available(r: Var) -> bool:
                return (r, 0) in cache or _live(r) is not None

            refs = self.derived.op_refs(record)
            plan = closure(refs, var, len(record.ops), available)
            code = self.derived.compiled(record, plan)
            if ps is None:
                with _recorder.paused(), torch.enable_grad(), below_autograd():
                    return run_plan(record, refs, code, plan, var, cache, (), {}, self._freed)
            targets, frontier = _wanted(self.derived, record, refs, ps, h, set(plan))
            produced: dict[Var, Tensor] = {}
            keep = targets.keys() | frontier.keys()
            with _recorder.paused(), torch.enable_grad(), below_autograd():
                value = run_plan(record, refs, code, plan, var, cache, keep, produced, self._freed)
            for n, v in produced.items():
                k = len(n.root.writes)
                for h2 in targets.get(n, ()):
                    ps.hold(h2, (n, k), v)
                if not n.root.writes:
                    for h2 in frontier.get(n, ()):
                        ps.hold(h2, (n, 0), v)
            self._served(ps, h)
            return value

    def dropped(self, hid: int) -> None:
        """Handle ``hid`` died: it releases what it held in the current pass; once
        none is left after the block closed, the record is released (P7)."""
        with self.lock:
            self.handles -= 1
            self.pending.pop(hid, None)
            ps = self.current
            if ps is not None:
                ps.pending.pop(hid, None)
                ps.release(hid)
                if not ps.pending:
                    self.current = None
            if self.handles == 0 and self.record is not None and not self.record.open:
                self.record = None
                self.current = None
                self.derived = Derived()

    # -- P4 bookkeeping

    def served(self, h: Handle) -> None:
        """``h`` was served without a replay (its value is in memory)."""
        with self.lock:
            ps = self.current
            if ps is not None and ps.task == current_graph_task():
                self._served(ps, h)

    def _pass(self, task: int) -> _Pass:
        ps = self.current
        if ps is None or ps.task != task:
            ps = self.current = _Pass(task, self.pending)
            ref = weakref.ref(self)  # the engine must not keep the block alive

            def end() -> None:
                state = ref()
                if state is not None:
                    state._end(task)

            queue_engine_callback(end)
        return ps

    def _end(self, task: int) -> None:
        with self.lock:
            if self.current is not None and self.current.task == task:
                self.current = None

    def _served(self, ps: _Pass, h: Handle) -> None:
        ps.serve(h)
        if not ps.pending:
            self.current = None  # nothing left to serve in this pass: free the cache

    @staticmethod
    def _freed(t: Tensor) -> bool:
        return any(fn(t) for fn in _freed_storage_handlers)
