"""A function-form scope's steady state: its block runs without the recorder.

The recorder is a TorchDispatchMode: a Python call per op, which on a GPU costs
more than the kernels it launches. A scope that runs a function (``apply_recompute``,
``@recompute``, ``checkpoint``) can instead have dynamo capture the function
(``torch.compile(fn, backend=<ours>, fullgraph=True)``): dynamo's guards prove, at
every call, that the function computes the same graph -- the same ops on tensors of
the same dtypes and devices, of the same shapes or of the sizes a dynamic graph
admits, with the same Python constants, branches and global state -- and our backend
runs that graph eagerly,
op by op, with autograd as usual (the kernels, so the gradients, are the plain
program's). A function's first call runs eagerly, recorded. The first run of a graph
(per scope options) is recorded as any block; it becomes the graph's template
(``_record.template``) once its structure is shown to be the eager program's. Later runs
take the recorder off the dispatch stack and bind their record from the template instead
(``_record.bind``), their saves taken in order by a sequencer (``_save.sequencer``)
(rules D1..D8).

RULES D1..D8: when a block runs in its steady state.

D1. [ which calls run steady ] Only a function-form scope, entered outside any open
    block and outside backward, with grad mode on, ``debug=False``, a ``save=`` that is
    not a context policy (it reads the running module and region of each op call, which
    a captured graph does not have), and no TorchDispatchMode, TorchFunctionMode or
    global module hook active, no hook on a module the function reaches (its module's
    submodules, modules in its closure, globals and arguments: ``module_hooks_reached``; the
    modules dynamo traced are guarded too: Q3 [ hooks are guarded ]), only a function whose code
    dynamo does not skip (torch's own modules' ``forward``: dynamo would run the call eagerly,
    unrecorded, and the call would then run again recorded), and only while
    ``GRADIENT_SCOPE_FAST`` allows it: on (``1``, ``true``, ``yes``, ``on``) always, off
    (``0``, ``false``, ``no``, ``off``) never, another word a ValueError (the words of
    ``GRADIENT_SCOPE_DISABLE``), unset when an argument of the function is a CUDA tensor
    (where host time is the bottleneck; on CPU the first call's compile costs more than it
    saves). A call recorded here is recorded alone: the function keeps its steady state.
D2. [ what dynamo cannot capture is recorded ] A call that dynamo cannot capture whole
    runs recorded, as any block: nothing of it ran before dynamo gave up. A function
    that failed twice (a graph break), that dynamo runs without our graph, or whose
    graph holds a nested scope (T4 [ no nested scope or higher-order op ]) is recorded
    from then on, for the life of the process, with every function of its code (a class
    made anew per model, a closure made per call: a recapture that fails again can leave
    dynamo holding the call's tensors) (logged: logger ``gradient_scope``, INFO); past
    dynamo's recompile limit, calls whose graph dynamo has keep their steady state and the
    others are recorded.
D3. [ saves checked against the template ] The saves of a steady run go to its sequencer
    (``_save.pack`` S5 [ a steady run's saves go to its sequencer ],
    ``_save.sequencer``), which takes the n-th save to be the template's n-th
    (T2 [ saves are classified as they happen ]) and checks its shape and dtype: a
    mismatch, or another number of saves, raises ``RecomputeError`` (never a silent
    wrong gradient) and retires the template. (Versions are not compared: a custom op
    that fills its output in place bumps the counter only without a dispatch mode. A
    handle of a tensor that dies in the run carries the template's version, which its
    recorded writes are counted in.)
D4. [ a steady run's record is bound ] The random states a run's random ops draw are
    read where the template says (T3 [ random states observed at saves ]), and bound
    (``_record.bind``) into the run's record with its Inputs, its output Vars (made when
    the tensor is first saved or when the graph returns; each replaces the template's
    Var in its op's outputs, noted in ``BlockRecord.renamed`` for the views that still
    name the template's) and its signature: replay, budgets, the report and
    ``model_stats`` read it as a recorded record.
D5. [ a run puts back what it set ] Everything a run sets (the thread's request, the
    sequencer, the recorder off the stack) is put back when it returns or raises.
D6. [ the graph must run the eager ops ] A graph stands for the function only where it
    runs the ops the function runs eagerly: dynamo traces code that branches on
    ``torch.compiler.is_compiling()`` down its compiled branch (Hugging Face's MoE
    experts, off bfloat16, take a loop of matmuls there). A function's first call in a
    scope runs eagerly, recorded, and the structure (signature) of every such eager run
    is noted per function and scope options. A graph's first run is recorded as usual;
    its structure must be one an eager run had, else the next call that reaches the
    graph runs eagerly instead (the graph raises before any op of it ran) and is
    compared: the same structure admits the graph, another one means the graph computes
    something else: the function is recorded from then on
    (D2 [ what dynamo cannot capture is recorded ]), with a warning, since one run per
    graph and options, the first, ran the graph before it could be compared.
D7. [ a dynamic graph has a template per size ] Dynamo captures a function's first call at its
    sizes and, when a later call differs in a size or an integer argument (a batch padded to
    another length), once more with that size symbolic: one graph for every length. A record
    holds sizes (a view's shape is an op argument), so such a graph keeps a template, and its
    check against an eager run, per sizes and integers of its arguments (``TEMPLATES_KEPT`` of
    them, the oldest dropped first): a new length costs one recorded run (the template) and
    one eager run (D6 [ the graph must run the eager ops ]), not a capture.
D8. [ captures must be reused ] A capture costs dynamo's trace (0.2-2 s on CPU for a
    transformer layer); a graph pays it back only when later calls run it. A function that
    changes at every call (a Python constant, a global, an object dynamo guards by identity)
    would pay a capture per call, up to the recompile limit. So per function code, the graphs
    dynamo made for the steady state and how many of them ran again are counted
    (``reuse.History``): a function may have ``CAPTURES_FREE`` graphs before any is reused, and
    ``CAPTURES_PER_REUSE`` more per graph reused (a model with a KV cache has a graph per
    layer, each reused at the next step). Past that, a call still runs a graph dynamo already
    has, but starts no capture: dynamo's accumulated recompile limit is 0 for the time of that
    call (``reuse.held_back``), so dynamo refuses before tracing anything, and the call is recorded
    (``recorded_why``: ``"captures not reused"``). After ``HELD_MAX`` such calls with no graph
    ever reused, the function is recorded from then on, said once at INFO.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..._base.feedback import warn_user
from ..._base.options import FAST_VAR, ScopeOptions, switch
from ..._base.rng import default_generators
from ..._base.torch_compat import (
    any_mode_active,
    current_graph_task,
    dynamo_skips,
    global_module_hooks_active,
    is_dynamo_error,
    is_higher_order_op,
    is_recompile_limit,
    module_hooks_reached,
)
from ..._record import recorder as _recorder
from ..._record.bind import Binding
from ..._record.signature import constants, signature
from ..._record.template import Log, Template, build
from ..._record.types import BlockRecord, Input
from ..._save.pack import sequencing
from ..._save.sequencer import Logger, Sequencer
from ..dynamo import entry, guard_hooks, hooks_guarded, hush, hushed
from .capture import COPIED, NodeValues, locate, take, with_extra_outputs
from .reuse import History, code_of, held_back, history

__all__ = ["run"]

Tensor = torch.Tensor
_log = logging.getLogger("gradient_scope")
_tls = threading.local()
# D2 [ what dynamo cannot capture is recorded ]: the code of functions recorded from now on (by
# code: a class made anew per model, a closure made per call, share it, as dynamo's cache does)
_failed: weakref.WeakSet[Any] = weakref.WeakSet()
# T6 [ kept ops' outputs taken from the graph ]: the code of functions a template of which took
# tensors from its graph's nodes
_takes: weakref.WeakSet[Any] = weakref.WeakSet()
_NOTHING = contextlib.nullcontext()
_RETIRED = object()  # a template that diverged (D3 [ saves checked against the template ])
#: D6 [ the graph must run the eager ops ]: per function's code, per scope options
#: (``_Request.key``), the structures of its eager runs (by code: a function made anew per call,
#: a lambda or a closure, shares them).
_eager: weakref.WeakKeyDictionary[Any, dict[Any, deque[Hashable]]] = weakref.WeakKeyDictionary()
_EAGER_KEPT = 8  # structures noted per code and options (shapes a function is called with)


class _RunEager(Exception):
    """Raised by a graph whose first run's structure no eager run has shown yet
    (D6 [ the graph must run the eager ops ]), before any of its ops ran: the call runs the
    function eagerly, and compares."""

    def __init__(self, graph: _Graph | None) -> None:
        super().__init__()
        self.graph = graph


def _eager_keys(fn: Callable[..., Any], key: Any) -> deque[Hashable]:
    code = code_of(fn)
    per = _eager.get(code)
    if per is None:
        per = _eager[code] = {}
    keys = per.get(key)
    if keys is None:
        keys = per[key] = deque(maxlen=_EAGER_KEPT)
    return keys


def _run_eager(req: _Request, args: tuple[Any, ...], kwargs: dict[str, Any], graph: _Graph | None) -> Any:
    """D6 [ the graph must run the eager ops ]: ``req``'s call run eagerly in its open block,
    recorded; its structure noted, and compared with the first run of ``graph`` where that graph
    asked for it."""
    out = req.fn(*args, **kwargs)
    block = req.block
    block.settle()
    key = _structure(block.record)
    keys = _eager_keys(req.fn, req.key)
    if key not in keys:
        keys.append(key)
    if graph is not None:
        graph.compared(req, key)
    return out


def _structure(record: BlockRecord) -> Hashable:
    """D6 [ the graph must run the eager ops ]: what a run computed (its signature and the
    Python numbers its ops took)."""
    return signature(record)[0], constants(record)


def _unwanted(opts: ScopeOptions, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """D1 [ which calls run steady ], before the scope is entered: why the call is recorded,
    or None."""
    setting = switch(FAST_VAR, "run function-form scopes in their steady state on every device")
    if setting is False:
        return "off"
    if opts.debug or opts.contextual:
        return "debug" if opts.debug else "context policy"
    if setting is None and not any(type(a) is Tensor and a.is_cuda for a in (*args, *kwargs.values())):
        return "off"
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled() or current_graph_task() != -1:
        return "no grad or in backward"
    if any_mode_active():
        return "dispatch or function mode"
    if global_module_hooks_active() or module_hooks_reached(fn, args, kwargs):
        return "module hook"
    func = getattr(fn, "__func__", fn)
    if not inspect.isfunction(func) or inspect.isgeneratorfunction(func) or inspect.iscoroutinefunction(func):
        return "not a function"
    if func.__code__ in _failed:
        return "given up"
    # dynamo would run a skipped frame eagerly, unrecorded (its random draws, its buffers' writes), and
    # fullgraph=True raise after: the call would run twice
    return "dynamo skips its code" if dynamo_skips(func) else None


class _Request:
    """One steady call of a scope (thread-local while the compiled function runs)."""

    __slots__ = ("key", "graph_key", "block", "entered", "save", "fn", "why", "past")

    def __init__(self, opts: ScopeOptions, block: Any, fn: Callable[..., Any]) -> None:
        self.fn = fn
        save = opts.save
        self.save = save  # held: the key names it by id
        self.key = (id(save), opts.preserve_rng_state)
        # a dynamic graph's: per sizes too (D7 [ a dynamic graph has a template per size ])
        self.graph_key: Any = self.key
        self.past: History = history(fn)  # D8 [ captures must be reused ]
        self.block = block
        self.entered = False
        self.why: str | None = "dynamo ran it without our graph"  # counted (ScopeStats.recorded_why)


def run(
    opts: ScopeOptions,
    scope: AbstractContextManager[Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run ``fn(*args, **kwargs)`` in ``scope`` (a scope with options ``opts``), in its
    steady state where D1 [ which calls run steady ] allows; counted in ``opts.stats``
    (steady, or recorded and why)."""
    why = _unwanted(opts, fn, args, kwargs)
    if why is not None:
        opts.stats.count_call(why)
        with scope:
            return fn(*args, **kwargs)
    with scope:
        block = _recorder.innermost()
        if block is None or len(block.frames) != 1 or block.frame.stats is not opts.stats or block.record.ops:
            # the scope records nothing (disabled) or is not alone
            opts.stats.count_call("disabled" if block is None else "nested")
            return fn(*args, **kwargs)
        req = _Request(opts, block, fn)
        if not _eager_keys(fn, req.key):  # D6 [ the graph must run the eager ops ]: the first call runs eagerly
            opts.stats.count_call("first call")
            return _run_eager(req, args, kwargs, None)
        return _captured(req, args, kwargs, not req.past.may_capture())  # D8 [ captures must be reused ]


def _captured(req: _Request, args: tuple[Any, ...], kwargs: dict[str, Any], held: bool) -> Any:
    """A call through dynamo (Q1 [ one entry, nothing kept per function ], quiet: Q2 [ our
    captures are quiet ]), or recorded where it cannot run the graph; ``held``: the call may
    run only graphs dynamo has (D8 [ captures must be reused ])."""
    fn = req.fn
    prior = getattr(_tls, "request", None)
    _tls.request = req
    failure: str | None = None
    eager = False
    graph: _Graph | None = None
    try:
        with _recorder.suspended(), hushed(), held_back() if held else _NOTHING:
            out = _entry(fn, *args, **kwargs)
    except _RunEager as e:
        # D6 [ the graph must run the eager ops ]: nothing of the graph ran (e is not kept:
        # its traceback holds this frame, whose locals hold the block's tensors)
        eager, graph = True, e.graph
    except Exception as e:
        if req.entered:
            raise
        # nothing ran (D2 [ what dynamo cannot capture is recorded ]): the function runs
        # recorded (and raises its own error)
        # (as text: the exception's traceback holds this frame, whose locals hold the block's
        # arguments, a reference cycle)
        failure = _failure(e)
        req.why = "dynamo could not capture"
        if held and is_recompile_limit(e):  # D8 [ captures must be reused ]
            req.why = "captures not reused"
            req.past.held += 1
            if req.past.hopeless():
                _give_up(fn, "dynamo makes a new graph at (almost) every call and none is run again")
    finally:
        _tls.request = prior
        req.block.frame.stats.count_call(req.why)
    if eager:
        return _run_eager(req, args, kwargs, graph)
    if req.why == "dynamo could not capture" or req.why == "captures not reused":
        out = fn(*args, **kwargs)
        if failure is not None:  # a user's exception raised again above is no failure to capture
            _failed_once(fn, failure)
        return out
    # D2 [ what dynamo cannot capture is recorded ]: dynamo ran it without our graph (no op, or
    # a skipped frame)
    if not req.entered:
        _give_up(fn, "dynamo ran it without our graph")
    return out


#: D2 [ what dynamo cannot capture is recorded ]: how often dynamo could not capture a function
#: (a capture is retried: a break may depend on the arguments); at ``_RETRIES`` it is recorded
#: from then on.
_failures: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_RETRIES = 2


def _failure(e: BaseException) -> str | None:
    """What counts of dynamo's exception ``e`` towards giving up, as text: None for the
    recompile limit (the graphs dynamo has keep running; this call is recorded, quietly: Q2)
    and for any exception not dynamo's."""
    if is_recompile_limit(e) or not is_dynamo_error(e):
        return None
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _failed_once(fn: Callable[..., Any], e: str) -> None:
    code = code_of(fn)
    n = _failures[code] = _failures.get(code, 0) + 1
    if n >= _RETRIES:
        _give_up(fn, e)


def _give_up(fn: Callable[..., Any], why: str) -> None:
    func = getattr(fn, "__func__", fn)
    if func.__code__ not in _failed:
        _failed.add(func.__code__)
        _log.info("gradient_scope: %s is recorded from now on (no steady state): %s", func.__qualname__, why)


def _backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    guard_hooks()  # Q3 [ hooks are guarded ]: dynamo builds this graph's guards after we return
    req: _Request | None = getattr(_tls, "request", None)
    past = req.past if req is not None else None
    if past is not None:  # D8 [ captures must be reused ]
        past.graphs += 1
    return _Graph(gm, any(_symbolic(a) for a in example_inputs), past)


def _symbolic(a: Any) -> bool:
    if isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    return isinstance(a, Tensor) and any(
        isinstance(d, torch.SymInt) for d in (*a.shape, *a.stride(), a.storage_offset())
    )


def _arguments(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """D7 [ a dynamic graph has a template per size ]: what a dynamic graph's symbols can stand
    for (every size, stride and offset of its tensor arguments, its numbers)."""
    return tuple(
        (a.shape, a.stride(), a.storage_offset()) if isinstance(a, Tensor) else a for a in args if isinstance(a, _SIZED)
    )


_SIZED = (Tensor, int, float, bool)
#: D7 [ a dynamic graph has a template per size ]: sizes a graph keeps a template for (the oldest
#: goes first: a size seen again after is recorded once more)
TEMPLATES_KEPT = 64


def _bounded(kept: dict[Any, Any]) -> dict[Any, Any]:
    """``kept`` with room for one more (D7 [ a dynamic graph has a template per size ])."""
    while len(kept) >= TEMPLATES_KEPT:
        del kept[next(iter(kept))]
    return kept


_entry = entry(_backend)


class _Graph:
    """What our backend gives dynamo for one captured graph: runs it eagerly, recorded
    the first time per scope options, bound from the template after
    (D3 [ saves checked against the template ], D4 [ a steady run's record is bound ])."""

    def __init__(self, gm: torch.fx.GraphModule, dynamic: bool, past: History | None) -> None:
        self.gm = gm
        self.dynamic = dynamic
        # D8 [ captures must be reused ]: its function's history, told when it first runs again
        self.past, self.runs = past, 0
        # (id of the save= option, preserve_rng_state) -> (that option, its template or
        # _RETIRED): the option is held, so that its id names it while the entry lives.
        self.templates: dict[Any, tuple[Any, Any]] = {}
        # D6 [ the graph must run the eager ops ]: per scope options, the structure of the
        # graph's first run, until an eager run of the function showed the same one.
        self.unverified: dict[Any, Hashable] = {}
        # T4 [ no nested scope or higher-order op ]: a nested scope's annotation, or a
        # higher-order op (a checkpoint's region, flex_attention: what it does is not the
        # recorder's to bind), is recorded every run.
        self.nested: bool = any(
            (isinstance(n.meta.get("custom"), dict) and "gradient_scope" in n.meta["custom"])
            or (n.op == "call_function" and is_higher_order_op(n.target))
            for n in gm.graph.nodes
        )

    def __call__(self, *args: Any) -> Any:
        hooks_guarded()
        req: _Request | None = getattr(_tls, "request", None)
        if req is None or req.entered:
            with _recorder.reinstated():
                return self.gm(*args)
        quiet = hush(False)  # Q2 [ our captures are quiet ]: the graph's ops speak as usual
        try:
            return self._run(req, args)
        finally:
            hush(quiet)

    def _run(self, req: _Request, args: tuple[Any, ...]) -> Any:
        # T4 [ no nested scope or higher-order op ]: recorded as usual, eagerly, now and
        # (D2 [ what dynamo cannot capture is recorded ]) from the next call on
        if self.nested:
            _give_up(req.fn, "a nested scope or a higher-order op in its graph")
            req.why = "nested scope or higher-order op"
            raise _RunEager(None)
        self.runs += 1
        if self.runs == 2 and self.past is not None:  # D8 [ captures must be reused ]
            self.past.reused += 1
        if self.dynamic:
            req.graph_key = (req.key, _arguments(args))
        pending = self.unverified.get(req.graph_key)
        if pending is not None:  # D6 [ the graph must run the eager ops ]
            if pending not in _eager_keys(req.fn, req.key):
                req.why = "graph checked against an eager run"
                raise _RunEager(self)
            del self.unverified[req.graph_key]
        req.entered = True
        found = self.templates.get(req.graph_key)
        tpl = found[1] if found is not None and found[0] is req.save else None
        if tpl is None:
            req.why = "first run of a graph"
            return self._first(req, list(args))
        if tpl is _RETIRED or tpl.context != req.block.context:  # T5 [ one numeric context ]
            req.why = "template retired" if tpl is _RETIRED else "numeric context"
            with _recorder.reinstated():
                return self.gm(*args)
        if tpl.captured and tpl.capture is None:
            req.why = "first run of a graph"
            return self._locate(req, tpl, list(args))
        req.why = None
        return _steady(self, tpl, req, list(args))

    def _locate(self, req: _Request, tpl: Template, args: list[Any]) -> Any:
        """T6 [ kept ops' outputs taken from the graph ]: the run after a template's first, where
        that first ran the graph whole: recorded again, node by node, to find the tensors."""
        values = NodeValues(self.gm)
        originals = req.block.inputs.keep_originals()
        with _recorder.reinstated():
            out = values.run(*args)
        req.block.settle()
        key, slots = signature(req.block.record)
        if key != tpl.key or not _located(tpl, values, slots, self.gm, originals):
            self.templates[req.graph_key] = (req.save, _RETIRED)
        return out

    def _first(self, req: _Request, args: list[Any]) -> Any:
        block = req.block
        log = Log()
        log.start = {g: g.get_state() for g in default_generators()}
        saved_before = block.frame.stats.ops_saved
        # T6 [ kept ops' outputs taken from the graph ]: where a template of the function took
        # tensors from its graph's nodes (a KV cache each layer writes to: a graph per layer, and
        # per length), this run runs node by node and finds them (an interpreter: ~30 us a node)
        code = code_of(req.fn)
        values = NodeValues(self.gm) if code in _takes else None
        originals = block.inputs.keep_originals() if values is not None else {}
        with _recorder.reinstated(), sequencing(Logger(block, log)):
            out = self.gm(*args) if values is None else values.run(*args)
        block.settle()
        tpl = build(block.record, log, args, out, len(block.frames), self.nested)
        if tpl is not None:
            tpl.ops_saved = block.frame.stats.ops_saved - saved_before
            if tpl.captured:
                _takes.add(code)
                if values is not None and not _located(tpl, values, signature(block.record)[1], self.gm, originals):
                    tpl = None
        _bounded(self.templates)[req.graph_key] = (req.save, tpl if tpl is not None else _RETIRED)
        key = _structure(block.record)
        # D6 [ the graph must run the eager ops ]: compared at the next call that reaches it
        if key not in _eager_keys(req.fn, req.key):
            _bounded(self.unverified)[req.graph_key] = key
        return out

    def compared(self, req: _Request, key: Hashable) -> None:
        """D6 [ the graph must run the eager ops ]: an eager run of a call that reached this
        graph, whose structure is ``key``."""
        pending = self.unverified.get(req.graph_key)
        if pending is None or pending == key:
            self.unverified.pop(req.graph_key, None)
            return
        if code_of(req.fn) in _failed:
            return
        func = getattr(req.fn, "__func__", req.fn)
        _give_up(req.fn, "its graph runs other ops than the function does eagerly")
        warn_user(
            f"gradient_scope: {func.__qualname__} runs other ops when dynamo traces it than when it runs "
            "eagerly (code that branches on torch.compiler.is_compiling(), e.g. Hugging Face's MoE "
            "experts off bfloat16). Its first captured run computed dynamo's version, as under "
            "torch.compile; from now on its scopes are recorded eagerly, with no steady state."
        )


def _located(
    tpl: Template, values: NodeValues, slots: Any, gm: torch.fx.GraphModule, originals: dict[int, Any]
) -> bool:
    """T6 [ kept ops' outputs taken from the graph ]: the nodes of ``gm`` whose values (``values``,
    of the recorded run ``tpl`` was built from, whose slots are ``slots``, whose Inputs copied
    at a write were read from ``originals``) hold the outside tensors the block makes itself,
    noted in ``tpl``; False where one is held by none."""
    held = [slots.refs[tpl.input_slots[k]] for k in tpl.captured]
    if not all(type(r) is Input for r in held):
        return False
    wanted = []
    for r in held:
        if r.snapshot:  # copied before the block's first write to it: the tensor it was read from
            t, version = originals.get(id(r), (None, None))
            if t is None or version != r.version:
                return False
            wanted.append((t, version, True))
        else:
            wanted.append((r.tensor, None, False))
    found = locate(values, wanted)
    if found is None:
        return False
    tpl.gm = with_extra_outputs(gm, found)
    tpl.capture = [(e, COPIED if f.copy else f.element, f.layout) for e, f in enumerate(found)]
    return True


def _steady(graph: _Graph, tpl: Template, req: _Request, args: list[Any]) -> Any:
    """D3 [ saves checked against the template ], D4 [ a steady run's record is bound ]: a run
    bound from ``tpl`` (``_record.bind``), its saves sequenced (``_save.sequencer``)."""
    block = req.block
    seq = Sequencer(tpl, block.frame, block.owner, Binding(tpl, block.record, block.frame, args))
    try:
        with sequencing(seq):
            out = (tpl.gm or graph.gm)(*args)
        taken: list[Any] = []
        # T6 [ kept ops' outputs taken from the graph ]: the graph returns the values that hold them
        # too
        if tpl.captured:
            n = len(out) - len(tpl.captured)
            out, extras = tuple(out[:n]), out[n:]
            if tpl.capture:
                taken = [extras[e] if j == COPIED else take(extras[e], j, layout) for e, j, layout in tpl.capture]
        seq.finish(out, taken)
    finally:
        if seq.diverged:  # D3 [ saves checked against the template ]: recorded from the next run on
            graph.templates[req.graph_key] = (req.save, _RETIRED)
    return out
