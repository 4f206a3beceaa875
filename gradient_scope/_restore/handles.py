"""Restore: the value a handle stands for, from memory or by a replay of its block's record.

Each block that has handles gets one :class:`ReplayState` (made with the block,
held by its handles and by its live tensors' registry entries, so that it and
the record die as soon as backward no longer needs the block). Which ops a
replay runs, and running them, is ``_restore.replay``'s.

RULES P1..P11: what a replay keeps.

P1. [ only the closure runs ] Only the recorded ops in the dependency closure of the
    requested value run, in recorded order, below autograd (no graph is built) with grad
    mode on, as in forward (some kernels, e.g. ``mkldnn_rnn_layer``, return fewer
    outputs under no_grad), and with autocast off: the record is already below autocast,
    so it holds the casts forward made. Random ops run with the generator state they had
    in forward, inside a fork that restores the ambient state.
P2. [ a handle is its tensor as saved ] A handle stands for its tensor as autograd saved
    it: the state of the tensor's storage group after every write the block recorded
    whose version is the saved one. (A kernel may save an argument before writing to it
    without bumping its version, as ``rrelu_with_noise`` does with its noise: that write
    is part of the saved value.) A recorded write that did bump the version after the
    save raises PyTorch's own in-place error, as PyTorch does.
P3. [ values in memory are used ] A value still in memory is used as it is: the tensor
    itself while it lives, or an alias another block holds of it
    (R5 [ another block's live tensor is noted ] in ``_record.entry``). A value a replay's plan
    finds alive is held until the replay has run: its holder (a KV cache in a reference cycle)
    may be collected in between.
P4. [ each op at most once per pass ] Within one backward pass each op runs at most
    once: values that other pending handles of the block will ask for (their own values,
    and the values their replays will read) are cached, each entry held by at least one
    pending handle; the cache is dropped when no pending handle is left or the pass
    ends. A served value is not copied, so its consumer may write into it (a custom
    backward using its saved tensor as scratch): each entry keeps the version it was
    cached at; a written entry is rebuilt for the values derived from it, and for a
    handle of the written tensor itself raises PyTorch's in-place error, as autograd
    would. A view is handed out sharing its base's version counter (``ViewSpec.apply``).
P5. [ replayed outputs are checked ] Every replayed output is checked against forward's
    shape, dtype and device (and values with ``debug=True``); a mismatch raises
    :class:`RecomputeError`.
P6. [ outside tensors must be unchanged ] An outside tensor the block read must be
    unchanged: same version and same storage. A freed storage is handed to the
    registered freed-storage handlers (FSDP2 re-gathers its parameters) before it is an
    error.
P7. [ the record lives with its handles ] A closed block's record (its ops and the
    aliases of its inputs) lives only as long as one of its handles: when autograd has
    released the last one, backward needs the block no more and the record is released,
    also while some of the block's tensors live on (a key/value cache). Such a tensor,
    saved after that, is stored.
P8. [ groups of separate counters ] A storage group with members of separate version
    counters (``unsafe_chunk`` pieces) that outlive the block can change without the
    saved tensor's version changing: later saves of it are stored, and a handle made
    earlier checks those members before a replay.
P9. [ stored values serve replays ] A value a budget stored (``_save.pack``
    S4 [ a budget's choice is stored ]) is, while autograd holds it, read by replays of
    other values as a cached value: their closures stop at it. A closed block is
    released (P7 [ the record lives with its handles ]) once no handle is left and no
    stored or offloaded value is alive (an offloaded one is noted by its packed object,
    which replays do not read), or at once when its budget kept every value it saved
    (nothing will be replayed). An outside tensor whose storage a budget offloaded in
    place is brought back by the freed-storage handlers before a handle is served from
    it (P3 [ values in memory are used ]). Served, a stored value is what a handle of it
    would be: a written tensor raises as P3 [ values in memory are used ] says; a stored
    copy written since the save, its tensor gone, raises PyTorch's in-place error if
    this backward pass handed it out (a consumer wrote it, as
    P4 [ each op at most once per pass ] says of a cached value) or if its block was
    released, and otherwise gives way to a replay of the value as saved
    (P2 [ a handle is its tensor as saved ]).
P10. [ a pass without a graph marks use ] A backward pass that unpacks a block's value
    without building a graph (no ``create_graph``) marks the block used once the pass
    has ended: a budget's step then no longer waits for it, though a retained graph
    keeps its handles (``_budget.budget`` M2 [ what a step is ]).
P11. [ a replay that communicates reads no liveness ] A block whose record holds a
    collective (``_record.wrappers.Collective``: tensor parallelism's redistributions, a
    functional collective) is replayed from its record, the pass's cache and what a
    budget stored only: no value in memory serves its handles or cuts its replays
    (P3 [ values in memory are used ] does not apply). What is alive differs by rank --
    a reference cycle one rank's garbage collector has freed and another's not yet --
    and every rank of the group must run the same collectives in the same order, or
    they wait on each other for ever.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._base import errors as _errors
from .._base.errors import RecomputeError, inplace_error, internal_error
from .._base.stats import ScopeStats
from .._base.subclass import storage_freed
from .._base.torch_compat import (
    below_autograd,
    current_graph_task,
    profiler_range,
    queue_engine_callback,
    set_grad_mode,
)
from .._record import recorder as _recorder
from .._record.registry import tensor_of, value_in_memory
from .._record.types import BlockRecord, Var, ViewSpec, moved
from .._record.wrappers import is_collective
from .replay import Derived, replay, restore_freed, same_values
from .structure import communicates

__all__ = ["Handle", "ReplayState", "materialize"]

Tensor = torch.Tensor
_REPLAY = "gradient_scope.replay"  # the profiler range of each replay pass


class Handle:
    """Stands in for a block tensor that autograd saved."""

    __slots__ = ("state", "var", "version", "view", "check", "itself", "__weakref__")

    def __init__(
        self,
        state: ReplayState,
        var: Var,
        version: int,
        view: ViewSpec | None,
        check: Tensor | None,
        itself: bool,
    ) -> None:
        self.state = state
        self.var = var  # of the tensor (or of the view's base); also its registry entry
        self.version = version  # of the tensor when autograd saved it
        self.view = view
        self.check = check  # debug=True: an alias of the saved tensor, compared at unpack
        # Whether autograd would keep the tensor itself (a saved input, not a view of a
        # block tensor): then it sees a storage swap after the save (`.data = ...`);
        # otherwise it keeps the data of the save.
        self.itself = itself

    def unpack(self) -> Tensor:
        state = self.state
        timer = state.timer
        if timer is not None:
            timer.unpacking()
        try:
            return materialize(self)
        except RecomputeError as e:
            _errors.with_site(e, self.var.frame.site if state.stats is None else state.site)
            raise
        finally:
            if timer is not None:
                timer.unpacked()

    def __del__(self) -> None:
        # Autograd released this saved tensor (P7 [ the record lives with its handles ]). At
        # interpreter shutdown the slots may already be cleared.
        state = getattr(self, "state", None)
        if state is not None:
            state.dropped(id(self))


def materialize(h: Handle) -> Tensor:
    """The value ``h`` stands for (P3 [ values in memory are used ], else a replay), as autograd
    saved it. With ``debug=True`` it is always replayed, then compared with the saved tensor."""
    var = h.var
    t = var()
    if t is not None and t._version != h.version:
        raise inplace_error(f"{t.type()} {list(t.shape)}", h.version, t._version)
    h.state.touched()
    # Most block tensors are dead in backward, with no alias: nothing in memory then.
    if h.check is None and (t is not None or var.aliases) and not h.state.communicates():
        t = value_in_memory(var, h.version)
    else:  # P11 [ a replay that communicates reads no liveness ]
        t = None
    if t is not None and storage_freed(t) and not restore_freed(t):
        t = None  # emptied by someone we cannot ask (P9 [ stored values serve replays ]): replay it
    if t is not None and not h.itself and moved(var, t):
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
    if h.check is not None and not same_values(value, h.check):
        raise RecomputeError(
            f"gradient_scope (debug): the recomputed {h.var.describe()} differs from the "
            "tensor autograd saved, whose version did not change: it was written through "
            "`.data`, a NumPy array (torch.from_numpy) or untyped_storage() after it was "
            "saved, or a tensor the block read was. Do not write to tensors a block made or "
            "read until backward has run."
        )
    return value


class _Pass:
    """Replay state of one block within one backward pass
    (P4 [ each op at most once per pass ]). Pending handles are held weakly; a handle that dies
    unserved releases what it held (``dropped``)."""

    __slots__ = ("task", "cache", "versions", "refs", "holds", "pending")

    def __init__(self, task: int, pending: dict[int, weakref.ref[Handle]]) -> None:
        self.task = task
        # Values keyed by (var, number of its group's writes applied), with the version
        # each had when cached: a consumer may write into a value it was handed (a
        # custom backward using its saved tensor as scratch), and the cache must see it.
        self.cache: dict[tuple[Var, int], Tensor] = {}
        self.versions: dict[tuple[Var, int], int] = {}
        self.refs: dict[tuple[Var, int], int] = {}  # holders of each entry
        # id(handle) -> the keys it holds; an id leaves before its handle dies.
        self.holds: dict[int, list[tuple[Var, int]]] = {}
        self.pending = dict(pending)  # id(handle) -> handle, not served in this pass yet

    def hold(self, h: Handle, key: tuple[Var, int], value: Tensor) -> None:
        if self.cache.get(key) is not value:
            self.cache[key] = value
            self.versions[key] = value._version
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
                self.versions.pop(key, None)

    def written(self, key: tuple[Var, int]) -> bool:
        """Whether the cached value of ``key`` was written since it was cached."""
        return self.cache[key]._version != self.versions[key]

    def drop_written(self) -> None:
        """Forget cached values written since they were cached: replay rebuilds them."""
        versions = self.versions
        for key in [k for k, v in self.cache.items() if v._version != versions[k]]:
            del self.cache[key]
            del versions[key]


class _Stored:
    """The part of a block's replay state that serves the values a budget stored
    (P9 [ stored values serve replays ]) and tells a budget which blocks a finished pass used
    (P10 [ a pass without a graph marks use ])."""

    __slots__ = ("kept", "handed", "touch", "used")
    record: BlockRecord | None
    lock: threading.RLock
    handles: int
    kept: dict[int, weakref.ref[Any]]
    handed: tuple[int, set[int]]
    touch: int
    used: bool

    def pending_backward(self) -> bool:  # (ReplayState's)
        raise NotImplementedError

    def replay(self, h: Handle) -> Tensor:  # (ReplayState's)
        raise NotImplementedError

    def release_if_done(self) -> None:  # (ReplayState's)
        raise NotImplementedError

    def awaited(self) -> bool:
        """Whether a backward pass is still to use this block
        (P10 [ a pass without a graph marks use ])."""
        return not self.used and self.pending_backward()

    def touched(self) -> None:
        """A value of this block is being unpacked (P10 [ a pass without a graph marks use ])."""
        task = current_graph_task()
        if task == -1 or task == self.touch or torch.is_grad_enabled():
            return
        self.touch = task
        ref = weakref.ref(self)  # the engine must not keep the block alive

        def end() -> None:
            state = ref()
            if state is not None:
                state.used = True

        queue_engine_callback(end)

    def hand_out(self, var: Var) -> None:
        """A stored value of ``var`` is handed to the current backward pass
        (P9 [ stored values serve replays ])."""
        task = current_graph_task()
        with self.lock:
            if self.handed[0] != task:
                self.handed = (task, set())
            self.handed[1].add(id(var))

    def handed_out(self, var: Var) -> bool:
        """Whether the current backward pass was handed a stored value of ``var``: if it
        was written since, a consumer wrote it (P4 [ each op at most once per pass ],
        P9 [ stored values serve replays ])."""
        task, handed = self.handed
        return task != -1 and task == current_graph_task() and id(var) in handed

    def replay_saved(self, var: Var, version: int, view: ViewSpec | None) -> Tensor:
        """``var``'s value as saved at ``version`` (``view`` of it), replayed
        (P2 [ a handle is its tensor as saved ]) for a stored value that no longer holds it
        (P9 [ stored values serve replays ])."""
        h = _Saved(var, version, view)
        value = self.replay(h)  # type: ignore[arg-type]
        if view is not None:
            with _recorder.paused(), below_autograd():
                value = view.apply(value)
        return value

    def release_all_kept(self) -> bool:
        """P9 [ stored values serve replays ]: a closed block with no handle, whose budget kept
        every value it saved, is released now. True if it was."""
        with self.lock:
            record = self.record
            if self.handles or record is None or record.open:
                return False
            self.kept = {}
            self.release_if_done()
            return self.record is None


class ReplayState(_Stored):
    """Replay bookkeeping of one block: its pending handles, the current pass's
    cache, what replay derives from its record. Only this class writes them, under
    ``lock``."""

    __slots__ = (
        "record",
        "lock",
        "pending",
        "handles",
        "current",
        "derived",
        "stats",
        "site",
        "timer",
        "__weakref__",
    )

    def __init__(self, record: BlockRecord) -> None:
        self.record: BlockRecord | None = record  # None once released (P7 [ the record lives with its handles ])
        # Where replays are counted and the site errors name, for a block whose Vars are
        # shared with other blocks (a steady-state run's: ``_adapters.steady``); None:
        # each Var's own frame's.
        self.stats: ScopeStats | None = None
        self.site: Any = None
        # Told of each unpack of one of the block's handles, before (``unpacking()``) and
        # after (``unpacked()``): a budget timing its measuring step (``_budget.timing``).
        self.timer: Any = None
        self.lock = threading.RLock()  # backward may run in another thread
        self.pending: dict[int, weakref.ref[Handle]] = {}  # live handles, by id
        self.handles = 0  # live handles
        self.current: _Pass | None = None
        self.derived = Derived()  # what replay derives from the record, once closed
        # P9 [ stored values serve replays ]: what a budget stored, by id (weakly: autograd owns
        # it; each has ``var``, ``view`` and ``alias``, the stored tensor, or None where the
        # pair below ours holds it), and what it offloaded (the packed object: no ``alias``).
        self.kept: dict[int, weakref.ref[Any]] = {}
        # The backward pass that last unpacked a stored value, and the Vars (by id: a Var
        # refers to this state) whose stored values it handed out
        # (P9 [ stored values serve replays ]: a consumer may write into one, as into a cached
        # value).
        self.handed: tuple[int, set[int]] = (-1, set())
        # the last backward pass that unpacked a value of the block
        # (P10 [ a pass without a graph marks use ])
        self.touch = -1
        # a pass that built no graph used the block and has ended
        # (P10 [ a pass without a graph marks use ])
        self.used = False

    def communicates(self) -> bool:
        """Whether a replay of the block may run a collective
        (P11 [ a replay that communicates reads no liveness ])."""
        record = self.record
        if record is None:
            return False
        if record.open:  # (its ops still change: not derived yet)
            return any(is_collective(rec.func) for rec in record.ops)
        return self.derived.of(record)[0].communicating is not None

    def replay_communicates(self, var: Var) -> bool:
        """Whether a replay of ``var`` from the block's inputs alone runs a collective
        (``_save.pack`` S1 [ block tensors become handles ] stores such a value saved after
        its block closed). Asked of every save of a block tensor: an open record (a save
        inside its block) answers before its ops are looked at."""
        record = self.record
        if record is None or record.open:
            return False
        st, slots = self.derived.of(record)
        return communicates(st, slots.of[id(var)])

    def note_kept(self, kept: Any) -> None:
        """``kept`` (held by autograd) stores one of this block's values, or is what
        one was offloaded into (P9 [ stored values serve replays ])."""
        with self.lock:
            self.kept[id(kept)] = weakref.ref(kept, _on_kept_death(weakref.ref(self), id(kept)))

    def pending_backward(self) -> bool:
        """Whether backward may still use this block: handles pending or values stored."""
        if self.record is None:
            return False
        return self.handles > 0 or bool(self.kept)

    def new_handle(self, var: Var, version: int, view: ViewSpec | None, check: Tensor | None, itself: bool) -> Handle:
        """A pending handle standing for ``var`` saved at ``version`` (the save path
        decided it is one: S1 [ block tensors become handles ] in ``_save.pack``)."""
        h = Handle(self, var, version, view, check, itself)
        with self.lock:
            self.pending[id(h)] = weakref.ref(h)
            self.handles += 1
        return h

    def replay(self, h: Handle) -> Tensor:
        """Recompute ``h``'s value (P1 [ only the closure runs ],
        P2 [ a handle is its tensor as saved ], P4 [ each op at most once per pass ])."""
        var = h.var
        root = var.root
        writes = root.writes
        for _, post in writes:
            if post is None:
                raise RecomputeError(
                    f"gradient_scope: cannot recompute a {var.describe()}: it was saved before the "
                    "block wrote to it with an op that is not replayed. Likely cause: a collective, "
                    "or a write the recorder did not see (a torch.compile'd function called in the "
                    "block that writes its argument in place, or another thread). Fix: make that "
                    "write out of place (or on a clone), do it before the tensor is saved, or keep "
                    "the tensor out of the recompute_scope."
                )
            if post > h.version:
                raise inplace_error(var.describe(), h.version, post)
        record = self.record
        if record is None:  # P7 [ the record lives with its handles ]: a live handle keeps its record
            internal_error("a block record was released early")
        escaped = record.escaped.get(root) if record.escaped and type(root) is Var else None
        for member, version in escaped.items() if escaped else ():  # P8 [ groups of separate counters ]
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
            if ps is None:
                with _Replaying():
                    kept = _with_kept(self.kept, {})
                    return replay(record, self.derived, var, kept, (), self._stats(var), not self.communicates())[0]
            key = (var, len(writes))
            cached = ps.cache.get(key)
            if cached is not None:
                if cached._version != ps.versions[key]:  # the same tensor, written by an earlier consumer
                    raise inplace_error(var.describe(), h.version, cached._version - ps.versions[key] + h.version)
                self._served(ps, h)
                return cached
            ps.drop_written()
            with _Replaying():
                cache = _with_kept(self.kept, ps.cache)
                live = not self.communicates()  # P11 [ a replay that communicates reads no liveness ]
                value, holds = replay(record, self.derived, var, cache, _wanted(ps, h, live), self._stats(var), live)
            hold = ps.hold
            for holder, key, v in holds:
                hold(holder, key, v)
            self._served(ps, h)
            return value

    def _stats(self, var: Var) -> ScopeStats:
        return var.frame.stats if self.stats is None else self.stats

    def dropped(self, hid: int) -> None:
        """Handle ``hid`` died: it releases what it held in the current pass; once
        none is left after the block closed, the record is released
        (P7 [ the record lives with its handles ])."""
        with self.lock:
            self.handles -= 1
            self.pending.pop(hid, None)
            ps = self.current
            if ps is not None:
                ps.pending.pop(hid, None)
                ps.release(hid)
                if not ps.pending:
                    self.current = None
            self.release_if_done()

    def release_if_done(self) -> None:
        """P7 [ the record lives with its handles ], P9 [ stored values serve replays ]: a
        closed block with no handle left and no stored value alive is released (call under
        ``lock``)."""
        record = self.record
        done = self.handles == 0 and record is not None and not record.open
        if done and not self.kept:
            self.record = self.current = None
            self.derived = Derived()

    # -- P4 [ each op at most once per pass ] bookkeeping

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


class _Replaying:
    """What a replay runs under (P1 [ only the closure runs ]): this thread's recorder paused,
    grad mode on, below autograd, and a profiler range while a profiler runs. One guard: a
    replay's fixed cost is paid once per replay pass of a block, several times per layer."""

    __slots__ = ("paused", "grad", "below", "range")

    def __enter__(self) -> None:
        self.paused = _recorder.paused()
        self.paused.__enter__()
        self.grad = torch.is_grad_enabled()
        set_grad_mode(True)
        self.below = below_autograd()
        self.below.__enter__()
        self.range = profiler_range(_REPLAY)
        self.range.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self.range.__exit__(None, None, None)
        finally:
            self.below.__exit__(None, None, None)
            set_grad_mode(self.grad)
            self.paused.__exit__()


def _wanted(ps: _Pass, h: Handle, live: bool) -> list[tuple[Var, Handle]]:
    """The values the other pending handles of the pass will ask for that are
    neither cached nor in memory (P4 [ each op at most once per pass ]), with the handle that
    will ask. ``live``: whether values in memory serve them
    (P11 [ a replay that communicates reads no liveness ])."""
    out: list[tuple[Var, Handle]] = []
    cache = ps.cache
    for ref in list(ps.pending.values()):
        h2 = ref()
        if h2 is None or h2 is h:
            continue
        n2 = h2.var
        root = n2 if n2.base is None else n2.base
        if (n2, len(root.writes)) in cache:
            continue
        # A value in memory serves h2 (P3 [ values in memory are used ]), except with
        # debug=True, which replays: then h2 shares this replay's value, as its tensor shares
        # storage in plain. (Most tensors are dead in backward, with no alias: nothing to look up.)
        in_memory = live and (n2() is not None or n2.aliases) and h2.check is None
        if in_memory and value_in_memory(n2, h2.version) is not None:
            continue
        out.append((n2, h2))
    return out


class _Saved:
    """What a replay of a stored value's value is asked for as
    (P9 [ stored values serve replays ]): a handle's ``var`` and ``version``, pending in no pass
    (no ``__del__``: it is no handle)."""

    __slots__ = ("var", "version", "view", "check")

    def __init__(self, var: Var, version: int, view: ViewSpec | None) -> None:
        self.var, self.version, self.view, self.check = var, version, view, None


def _with_kept(
    kept: dict[int, weakref.ref[Any]], cache: dict[tuple[Var, int], Tensor]
) -> dict[tuple[Var, int], Tensor]:
    """``cache`` and the stored values still held by autograd, as saved
    (P9 [ stored values serve replays ])."""
    if not kept:
        return cache
    out = dict(cache)
    for ref in list(kept.values()):
        k = ref()
        if k is None or getattr(k, "alias", None) is None or k.view is not None:
            continue  # gone, offloaded (no alias), held by the pair below ours, or a view
        var: Var = k.var
        if not var.root.writes and k.alias._version == var.version:
            out.setdefault((var, 0), k.alias)
    return out


def _on_kept_death(ref: weakref.ref[ReplayState], key: int) -> Callable[[object], None]:
    """The callback of a stored value's weak reference: the last one may release its
    block (P9 [ stored values serve replays ]). Holds its state weakly (no reference cycle)."""

    def died(_: object) -> None:
        state = ref()
        if state is not None:
            with state.lock:
                state.kept.pop(key, None)
                state.release_if_done()

    return died
