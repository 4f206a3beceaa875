"""Scopes under ``torch.compile``: an FX annotation, a joint-graph pass, no stale cache.

Inside code that dynamo traces, a :class:`~gradient_scope.recompute_scope` is not a
dispatch mode and saved-tensor hooks (no Python runs per op in a compiled graph). It
becomes an annotation of the graph instead, and the compiled backward recomputes the
block's tensors:

1. ``recompute_scope(...)`` while dynamo traces (``recompute_scope.__new__`` calls
   :func:`traced_block`) returns a ``contextmanager`` around
   ``torch.fx.traceback.annotate({"gradient_scope": (region, scope_id)})``, which dynamo
   traces: every node the block creates carries the annotation in
   ``node.meta["custom"]``, in the dynamo graph and, through AOTAutograd, in the joint
   forward+backward graph.
2. :func:`_prepare` runs for real while dynamo traces (``assume_constant_result``): it
   checks the options, registers the ``save=`` policy and the scope's stats under
   ``scope_id`` (side effects in *traced* code would only be replayed after the graph
   runs, too late for the compiler), and opens a compile session.
3. The session chains :func:`_tag_joint_graph` in front of whatever
   ``torch._functorch.config.joint_custom_pass`` holds, for every AOTAutograd backend
   (``aot_eager``, inductor, ...); dynamo's end-of-compile callback puts the config back
   exactly as it was. The pass marks the block's forward nodes
   ``CheckpointPolicy.MUST_RECOMPUTE`` (``MUST_SAVE`` for ops the ``save=`` policy keeps,
   and for collectives and ops whose outputs decide routing, as in eager),
   with one ``ac_graph_id`` per outermost scope (a scope with a budget: ``MUST_SAVE`` for
   what its plan keeps, :mod:`.budget`), so the min-cut partitioner recomputes
   them in the backward graph, also where an op after the block saves them; random ops
   in the block are replayed with the RNG state they drew in forward (the partitioner's
   ``functionalize_rng_ops``). In a graph with a scope, every forward read of a graph
   input the graph writes (AOTAutograd applies such writes when the forward ends) is
   ``MUST_SAVE`` instead: the backward would read the new value
   (:mod:`._compile_inputs`).
4. The AOTAutograd cache key in torch 2.13 does not include ``node.meta["custom"]``: a
   scoped graph could be served the artifact of the same graph without the scope (and
   the other way round). Every graph with a scope therefore contains a call of
   :func:`_aot_cache_bypass`, a no-op function allowed in the graph that AOTAutograd's
   cache does not know, so it neither loads nor stores these graphs; AOTAutograd traces
   the call away (it runs no op), so it costs nothing at run time. Caches of other
   graphs, and inductor's FX graph cache of the partitioned graphs, work as usual.

A graph break inside a block makes dynamo run the frame with the block eagerly: the
scope is then an eager scope, and while its block is open the frames it calls run
eagerly too and are recorded (``recompute_scope.__enter__``), instead of being compiled
as frames of their own. A compiled function called *inside an eager block* is compiled (the recording mode says
``ignore_compile_internals``) and what runs inside its graph is stored as the compiled
graph decides: :func:`._torch_compat.in_compiled_code` tells the recording mode which ops a compiled
artifact runs, and the mode lets them through unrecorded.

This module imports ``torch._dynamo``; it is imported only by ``recompute_scope.__new__``
while dynamo traces.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import re
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._dynamo
import torch._functorch.config as _functorch_config

from ..._base.errors import check_bool
from ..._base.feedback import warn_once
from ..._base.options import scopes_disabled
from ..._base.stats import ScopeStats, sink_by_key
from ..._base.torch_compat import OpOverload, op_schema
from ..._budget.budget import budget_by_key
from ...policies import NAME_KEY, ContextPolicy, OpContext, as_save_policy, is_built_in
from .budget import VERSION_BYTES, keep_within, kept_always, nbytes
from .inputs import pin_reads_of_written_inputs
from .versions import checkable_inputs, guard_input_versions

__all__ = ["CompiledScope", "traced_block", "ANNOTATION_KEY"]

ANNOTATION_KEY = "gradient_scope"


# ------------------------------------------------------------------ what is needed


def _missing_piece() -> str | None:
    """What this torch lacks for compiled scopes (None: nothing)."""
    import torch.fx.traceback as fx_traceback

    if not callable(getattr(fx_traceback, "annotate", None)):
        return "torch.fx.traceback.annotate"
    try:
        from torch._dynamo.variables.ctx_manager import FxTracebackAnnotateVariable  # noqa: F401
    except ImportError:
        return "dynamo support for torch.fx.traceback.annotate"
    if not hasattr(_functorch_config, "joint_custom_pass"):
        return "torch._functorch.config.joint_custom_pass"
    try:
        from torch.utils.checkpoint import CheckpointPolicy  # noqa: F401
    except ImportError:
        return "torch.utils.checkpoint.CheckpointPolicy"
    handler = getattr(torch._dynamo, "callback_handler", None)
    if handler is None or not isinstance(getattr(handler, "end_callbacks", None), list):
        return "_callback_handler()"
    if not hasattr(torch.fx.node, "has_side_effect"):
        return "torch.fx.node.has_side_effect"
    return None


_MISSING: str | None = _missing_piece()
_warned = False


def _warn_fallback(missing: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"gradient_scope: this torch ({torch.__version__}) lacks {missing}, which "
        "recompute_scope needs to become part of a compiled graph. Scopes inside "
        "torch.compile'd code run eagerly instead: dynamo breaks the graph around them "
        "(fullgraph=True then raises). Gradients are unaffected. Use torch >= 2.13 to "
        "compile scoped code.",
        UserWarning,
        stacklevel=2,
    )


# ------------------------------------------------------------------ compiled scopes


class CompiledScope:
    """What ``with recompute_scope(...) as scope`` gives inside compiled code.

    One per scope in the traced code (not one per call: the compiled graph runs
    without Python). ``stats`` are filled once, when the graph is compiled for
    training: ``ops_recorded`` counts the block's ops in the compiled forward graph,
    ``tensors_packed`` / ``bytes_packed`` the distinct block tensors that the
    backward graph needs and recomputes instead of saving (views of them are not
    counted again). ``replays`` and ``ops_replayed`` stay 0: the recomputation is part of
    the compiled backward graph, which counts nothing.

    Example::

        >>> import torch
        >>> from gradient_scope import recompute_scope
        >>> @torch.compile(backend="aot_eager", fullgraph=True)
        ... def f(x):
        ...     with recompute_scope() as scope:
        ...         h = x.sin().exp()
        ...     return h * x, scope
        >>> x = torch.randn(8, requires_grad=True)
        >>> y, scope = f(x)
        >>> scope.stats.ops_recorded, scope.stats.replays   # sin, exp; nothing replayed in Python
        (2, 0)
        >>> y.sum().backward()
        >>> torch._dynamo.reset()   # (drops compiled code; keeps this doctest's namespace tidy)
    """

    __slots__ = ("stats", "options", "__weakref__")

    def __init__(self, options: dict[str, Any]) -> None:
        self.stats = ScopeStats()
        self.options = options

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"<compiled recompute_scope({opts}): {self.stats}>"


class _Entry:
    __slots__ = ("policy", "scope", "budget")

    def __init__(self, policy: Callable[[Any], bool] | None, scope: CompiledScope, budget: Any = None) -> None:
        self.policy = policy
        self.scope = weakref.ref(scope)
        self.budget = budget  # a Budget: the pass keeps what its plan picks (``.budget``)


# scope_id -> policy and stats of a scope met while tracing. The stats object is held
# weakly (the compiled graph holds it); entries whose graph is gone are pruned.
_ENTRIES: dict[int, _Entry] = {}
_ids = itertools.count(1)


def _prepare(
    preserve_rng_state: Any = True,
    save: Any = None,
    enabled: Any = True,
    debug: Any = False,
    budget_given: int | bool = False,
    sink: int = 0,
) -> tuple[Any, CompiledScope]:
    """Run for real while dynamo traces (``assume_constant_result``): check the options,
    register the scope, open the compile session. Returns ``(spec, scope)``: ``spec`` is
    the annotation value ``(region, scope_id)``, None for a no-op block, or
    ``"eager"`` when this torch cannot compile scopes. ``budget_given``: the key of the
    scope's ``Budget`` (``_budget.budget.budget_by_key``), whose plan the joint-graph pass
    applies (``.budget``). ``sink``: the key of a model helper's stats
    (``_base.stats.compiled_sink``) that the scope's compile-time figures add into."""
    budget = budget_by_key(budget_given) if type(budget_given) is int else None
    options = dict(
        preserve_rng_state=check_bool("recompute_scope", "preserve_rng_state", preserve_rng_state),
        save=save,
        enabled=check_bool("recompute_scope", "enabled", enabled),
        debug=check_bool("recompute_scope", "debug", debug),
    )
    policy = as_save_policy(save)
    scope = CompiledScope(options)
    shared = sink_by_key(sink) if type(sink) is int and sink else None
    if shared is not None:
        scope.stats = shared  # each graph compiled adds its figures: the module's total
    if _MISSING is not None:
        _warn_fallback(_MISSING)
        return "eager", scope
    if not enabled or not torch.is_grad_enabled() or torch.is_inference_mode_enabled() or scopes_disabled():
        return None, scope  # as in eager: a block that records nothing
    if len(_ENTRIES) >= 1024:  # forget scopes of graphs that no longer exist
        for key in [k for k, e in _ENTRIES.items() if e.scope() is None]:
            del _ENTRIES[key]
    scope_id = next(_ids)
    _ENTRIES[scope_id] = _Entry(policy, scope, budget)
    # Nested in another scope of this graph: the same region (as eager scopes record
    # into the enclosing block), so the partitioner keeps no boundary between them.
    # annotate() of the enclosing scope has really run while dynamo traced it.
    import torch.fx.traceback as fx_traceback

    outer = (fx_traceback.current_meta.get("custom") or {}).get(ANNOTATION_KEY)
    region = outer[0] if outer is not None else scope_id
    if not torch.compiler.is_exporting():
        _open_session()
    return (region, scope_id), scope


_prepare = torch._dynamo.assume_constant_result(_prepare)


def _aot_cache_bypass() -> None:
    """Called in every graph that contains a scope: AOTAutograd's cache bypasses a graph
    with a call it does not know (see the module docstring). Does nothing."""


torch._dynamo.allow_in_graph(_aot_cache_bypass)
if hasattr(torch.fx.node, "has_side_effect"):
    torch.fx.node.has_side_effect(_aot_cache_bypass)  # dynamo must not drop the call


@contextlib.contextmanager
def _block(spec: tuple[int, int], scope: CompiledScope) -> Iterator[CompiledScope]:
    with torch.fx.traceback.annotate({ANNOTATION_KEY: spec}):
        yield scope


def traced_block(*args: Any, **options: Any) -> Any:
    """``recompute_scope(**options)`` while dynamo traces: a context manager it traces,
    or None where this torch cannot compile scopes (the scope then runs eagerly)."""
    if args:
        raise TypeError("recompute_scope() takes keyword options only, e.g. recompute_scope(save=...)")
    spec, scope = _prepare(**options)
    if spec == "eager":
        return None
    if spec is None:
        return contextlib.nullcontext(scope)
    _aot_cache_bypass()
    return _block(spec, scope)


# ------------------------------------------------------------------ the compile session


class _ChainedPass:
    """``joint_custom_pass`` while a compile session is open: tags the joint graph,
    then runs the pass that was installed before (if any)."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.active = True

    def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Any) -> Any:
        if self.active:
            _tag_joint_graph(gm)
        if callable(self.previous):
            return self.previous(gm, joint_inputs)
        return gm


_session: _ChainedPass | None = None


def _open_session() -> None:
    """Install the tagging pass until the end of the current dynamo compile."""
    global _session
    if _session is not None:
        return
    ours = _ChainedPass(_functorch_config.joint_custom_pass)
    _functorch_config.joint_custom_pass = ours
    _session = ours
    _callback_handler().register_end_callback(_close_session)


def _callback_handler() -> Any:
    return getattr(torch._dynamo, "callback_handler")  # noqa: B009  (not re-exported)


def _close_session(*args: Any) -> None:
    """Dynamo's end-of-compile callback: put ``joint_custom_pass`` back as it was."""
    global _session
    ours = _session
    _session = None
    if ours is not None:
        ours.active = False  # inert even where something else kept a reference to it
        if _functorch_config.joint_custom_pass is ours:
            _functorch_config.joint_custom_pass = ours.previous
    # Dynamo is iterating over this list right now: dropping its last element ends
    # the iteration as it would have ended; any other change must not touch the list
    # being iterated, so it gets a new list without this callback.
    handler = _callback_handler()
    callbacks = handler.end_callbacks
    if callbacks and callbacks[-1] is _close_session and callbacks.count(_close_session) == 1:
        callbacks.pop()
    elif _close_session in callbacks:
        handler.end_callbacks = [cb for cb in callbacks if cb is not _close_session]


# ------------------------------------------------------------------ the joint-graph pass


def _backward_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The backward part of the joint graph: AOTAutograd tags it (torch 2.13); where
    it does not, the nodes that depend on a tangent."""
    nodes = list(gm.graph.nodes)
    if any("partitioner_tag" in n.meta for n in nodes):
        return {n for n in nodes if n.meta.get("partitioner_tag") == "is_backward" or n.meta.get("autograd_backward")}
    seen: set[torch.fx.Node] = set()
    stack = [n for n in nodes if n.op == "placeholder" and "tangents" in n.name]
    while stack:
        n = stack.pop()
        for user in n.users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    schema = op_schema(target)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _decide(node: torch.fx.Node, scope_id: int, policy: Any, decisions: dict[tuple[int, Any], bool]) -> bool:
    """Whether ``policy`` keeps ``node``'s outputs: an op policy once per op of a scope, a
    context policy once per node (with what the node's meta says of it)."""
    if isinstance(policy, ContextPolicy):
        ctx = OpContext(node.target, _meta_args(node.args), _static(node.meta.get("val")), _name(node), _path(node))
        save = policy(ctx)
        ctx.release()
        decisions[(scope_id, None)] = decisions.get((scope_id, None), False) or save
        return save
    key = (scope_id, node.target)
    found = decisions.get(key)
    if found is None:
        found = decisions[key] = bool(policy(node.target))
    return found


def _static(val: Any) -> Any:
    """A node's example value with concrete sizes (a symbolic size: the size it was traced
    with), so that a policy can compare sizes without adding guards."""
    if isinstance(val, (tuple, list)):
        return tuple(_static(v) for v in val)
    if not isinstance(val, torch.Tensor) or all(isinstance(d, int) for d in val.shape):
        return val
    hinted = [d if isinstance(d, int) else (d.node.hint or 0) for d in val.shape]
    return torch.empty(hinted, dtype=val.dtype, device="meta")


def _meta_args(args: Any) -> tuple[Any, ...]:
    return tuple(_static(a.meta.get("val")) if isinstance(a, torch.fx.Node) else a for a in args)


def _name(node: torch.fx.Node) -> str | None:
    custom = node.meta.get("custom")
    return custom.get(NAME_KEY) if isinstance(custom, dict) else None


def _path(node: torch.fx.Node) -> str:
    """The module path of a traced op from its ``nn_module_stack``: the innermost entry
    (``"L['self'].layers.0.fc"``) without its first step, the variable the compiled code
    read the module from (the compiled module, or a global), as eager names it."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    inner = str(list(stack.values())[-1][0])
    path = re.sub(r"\['([^']*)'\]", r".\1", re.sub(r"\[(\d+)\]", r".\1", inner))
    # ``_modules`` steps, and the module that apply_recompute's forward refers to weakly.
    parts = path.replace("._modules.", ".").replace(".forward._module()", "").split(".")
    return ".".join(parts[2:]) if parts[0] in ("L", "G") else ".".join(parts[1:])


def _check_matched(tagged: list[tuple[torch.fx.Node, _Entry]], decisions: dict[tuple[int, Any], bool]) -> None:
    """A built-in policy that kept no node of a scope warns, once per policy (as in eager)."""
    scopes = {id(entry): entry for _, entry in tagged if is_built_in(entry.policy)}
    for entry in scopes.values():
        ids = {sid for sid, e in _ENTRIES.items() if e is entry}
        if not any(save for (sid, _), save in decisions.items() if sid in ids):
            name = getattr(entry.policy, "__name__", repr(entry.policy))
            warn_once(
                ("policy matched nothing", name),
                f"gradient_scope: save={name} matched no op of a compiled scope: nothing is stored, "
                f"everything is recomputed. The model may not run the ops {name} names (e.g. attention "
                "that is not an F.scaled_dot_product_attention kernel); name them (save=[...]) or use a "
                "context policy (gradient_scope.policies.context_policy). Warned once per policy.",
            )


def _apply_budgets(
    tagged: list[tuple[torch.fx.Node, _Entry]], backward: set[torch.fx.Node], checked: int
) -> list[tuple[Any, tuple[int, float, int]]]:
    """The scopes with a budget: keep what its plan picks, recompute the rest (``.budget``).
    Returns each budget with its plan's figures, noted once the version check is known."""
    from torch.utils.checkpoint import CheckpointPolicy

    groups: dict[int, tuple[Any, dict[Any, list[torch.fx.Node]]]] = {}
    for node, entry in tagged:
        if entry.budget is not None:
            regions = groups.setdefault(id(entry.budget), (entry.budget, {}))[1]
            regions.setdefault(node.meta["ac_graph_id"], []).append(node)
    planned = []
    for budget, regions in groups.values():
        kept, figures = keep_within(budget, regions, backward, checked)
        planned.append((budget, figures))
        for nodes in regions.values():
            for node in nodes:
                keep = node in kept or kept_always(node)
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.MUST_RECOMPUTE
    return planned


def _recomputes(backward: set[torch.fx.Node]) -> bool:
    """Whether the partitioner will rerun a tagged op in the backward: a ``MUST_RECOMPUTE``
    op (not a view, alias or tuple access: those are recomputed from what is saved, as in
    the program without scopes) whose value the backward needs, directly or through other
    recomputed nodes."""
    from torch.utils.checkpoint import CheckpointPolicy

    stack = [a for n in backward for a in n.all_input_nodes]
    seen: set[torch.fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen or node in backward or node.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE:
            continue
        seen.add(node)
        if isinstance(node.target, OpOverload) and not _is_view(node) and node.target not in _ALIASES:
            return True
        stack.extend(node.all_input_nodes)
    return False


def _tag_joint_graph(gm: torch.fx.GraphModule) -> None:
    """Mark the scopes' forward nodes MUST_RECOMPUTE / MUST_SAVE for the partitioner."""
    from torch.utils.checkpoint import CheckpointPolicy

    backward = _backward_nodes(gm)
    decisions: dict[tuple[int, Any], bool] = {}
    tagged: list[tuple[torch.fx.Node, _Entry]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in backward:
            continue
        custom = node.meta.get("custom")
        spec = custom.get(ANNOTATION_KEY) if isinstance(custom, dict) else None
        if spec is None:
            continue
        region, scope_id = spec
        entry = _ENTRIES.get(scope_id)
        if entry is None:  # pragma: no cover - registered while tracing this graph
            continue
        save = kept_always(node)
        if not save and entry.policy is not None and isinstance(node.target, OpOverload):
            save = _decide(node, scope_id, entry.policy, decisions)
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = region
        tagged.append((node, entry))
    _check_matched(tagged, decisions)
    planned = _apply_budgets(tagged, backward, checkable_inputs(gm) if tagged else 0)
    # getitem of a multi-output op follows its op (a tuple itself cannot be saved).
    for node, _ in tagged:
        if node.target is not operator.getitem:
            continue
        parent = node.args[0]
        if isinstance(parent, torch.fx.Node) and "recompute" in parent.meta:
            node.meta["recompute"] = parent.meta["recompute"]
    # A graph input the graph writes holds its new value when the backward runs:
    # whatever reads it is stored, never recomputed (in or out of the blocks).
    # Where no block op is recomputed (a budget at plain's bytes or more), the backward
    # reads what the program without scopes reads: that program's, version check
    # included (PyTorch's own error for a write after forward; no saved versions).
    checked = 0
    if tagged:
        pin_reads_of_written_inputs(gm, backward)
        if _recomputes(backward):
            checked = guard_input_versions(gm, backward)
    cpu = any(getattr(n.meta.get("val"), "device", None) == torch.device("cpu") for n, _ in tagged)
    for budget, (device_bytes, recompute, floor) in planned:
        budget._note_compiled(device_bytes + (checked * VERSION_BYTES if cpu else 0), recompute, floor)
    # Compile-time stats: block ops, and block tensors the backward graph reads.
    for node, entry in tagged:
        scope = entry.scope()
        if scope is None:
            continue
        stats = scope.stats
        if node.target is operator.getitem or node.target in _ALIASES:
            continue  # not ops of the block: tuple access, aliases AOTAutograd adds
        stats.ops_recorded += 1
        if (
            node.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
            and not _is_view(node)
            and isinstance(node.meta.get("val"), torch.Tensor)
            and any(u in backward or (u.target in _ALIASES and any(v in backward for v in u.users)) for u in node.users)
        ):
            stats.tensors_packed += 1
            stats.bytes_packed += nbytes(node.meta["val"])  # (symbolic sizes: at their hint)
