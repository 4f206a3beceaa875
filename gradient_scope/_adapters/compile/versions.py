"""Parameters written between a compiled forward and its backward: a RecomputeError.

The compiled backward recomputes a block's tensors from the graph's inputs. AOTAutograd
saves an input the backward reads with ``ctx.save_for_backward``, so a write to it
after the forward makes autograd's version check raise PyTorch's own in-place
``RuntimeError`` when the backward unpacks its saved tensors, before any op of the
backward graph runs. In a graph with a scope, for the weights that the backward reads
(a block's recomputation, or a backward op, reads them or a view of them), the
joint-graph pass replaces that check by one that says what happened and what to do.
Weights: the parameters and buffers (AOTAutograd's static inputs) and the inputs that
are leaf tensors requiring grad (``b = torch.zeros(8, requires_grad=True)``, a global
or an argument: trained as parameters are, but not static inputs).
An optimizer step writes every parameter: all of those the backward reads must be
checked by the same op, or autograd's check of another one raises first.

1. a forward op, ``gradient_scope::input_versions``, returns their version counters
   (an int64 CPU tensor, one entry per input). It is ``MUST_SAVE`` and has a side
   effect, so the partitioner keeps it in the forward graph and saves its result: a
   pure op that only the backward reads would be moved to the backward graph and read
   the versions there. Its result is kept on ``ctx`` too (step 2), so saved-tensor
   hooks never see it.
2. The inputs are marked ``saved_tensor_with_no_vc_check``: AOTAutograd keeps them on
   ``ctx`` without autograd's version check. They are weights, alive anyway (a leaf's
   AccumulateGrad node holds it): holding them until the graph is freed costs no memory.
   Other inputs (activations, data) keep autograd's check: held on ``ctx``, they would
   outlive the backward.
3. A backward op, ``gradient_scope::check_input_versions``, has a side effect (it is
   never dropped) and reads a tangent (so the partitioner puts it in the backward
   graph, which runs it on every backward call). It compares the versions and raises
   :class:`RecomputeError` that names the first input written since the forward. The
   backward graph returns no gradient before it has run, so a write the version
   counter sees never reaches a gradient.
4. Which inputs the backward reads is known for sure only once the partitioner has
   chosen what to save: besides what the joint graph shows (a block's recomputation, a
   backward op), it may save a parameter to recompute a cheap op outside the blocks
   itself (``gelu(h + bias)``). AOTAutograd's ``_extract_fwd_bwd_modules``, which every
   partitioner calls with the values it saves, is wrapped: the weights
   (or views of them) among those values join the two ops' lists before the graphs
   are cut. And ``functionalize_rng_ops`` is wrapped: it appends the RNG states of the
   random ops the backward replays after the tensors saved without a check, where
   AOTAutograd, which counts those by their nodes' meta, would take the last of them
   for RNG states (and check the first of ours); it marks the RNG states too. Both
   wrappers act only on graphs with these ops.

A graph whose scopes recompute nothing (a budget at plain's bytes or more) reads in its
backward what the graph without scopes reads: it is that program, autograd's check
included, and gets no version ops (the joint-graph pass asks ``_recomputes`` first).

Inputs the graph writes itself (:mod:`._compile_inputs`) keep autograd's check:
their versions move during the call. Nothing changes (the inputs keep autograd's check
and its error) where AOTAutograd's metadata is not found (another torch), and for
graphs compiled for CUDA graphs (``mode="reduce-overhead"``), whose replays would not
run the ops' Python. An inference tensor has no version counter: the forward op raises
RecomputeError for it, where autograd would refuse to save it.

Cost per call: one call of each op, a Python function through the dispatcher (the
forward one reads N version counters into an N-element int64 tensor kept for backward,
the backward one compares them; N = the weights checked): about
5-10 us each for N <= 8, 30-40 us for N = 64 (CPU, torch 2.13).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import re
import sys
from typing import Any

import torch
import torch._functorch.partitioners as _partitioners

from ..._base.errors import INPUT_WRITTEN, WEIGHT_UPDATE, RecomputeError
from .inputs import caller_locals, is_alias, written_inputs

__all__ = ["guard_input_versions", "checkable_inputs"]

# AOTAutograd's names: the joint pass's caller and its locals, the function whose
# local ``mod`` is dynamo's graph, and the meta key of a tensor saved without a
# version check (torch/_functorch/partitioners.py; runtime_wrappers.py).
_PARTITION = "_partition_joint_graph_into_fw_bw"
_SIMPLIFIED = "aot_module_simplified"
_NO_VC_CHECK = "saved_tensor_with_no_vc_check"
_CANDIDATE = "gradient_scope_input_name"  # a parameter or buffer that may be checked: its name


# Plain dispatcher ops with Python kernels (torch.library.custom_op adds ~60 us of
# Python per call; these cost ~5-10 us). The kernels run in the compiled graphs, under
# every backend; the fake kernels give their outputs while graphs are compiled.
_LIB = torch.library.Library("gradient_scope", "FRAGMENT")
_LIB.define("input_versions(Tensor[] tensors, str names) -> Tensor")
_LIB.define("check_input_versions(Tensor grad, Tensor versions, Tensor[] tensors, str names) -> ()")


def _versions(tensors: list[torch.Tensor], names: str) -> list[int]:
    try:
        return [t._version for t in tensors]
    except RuntimeError:
        for t, name in zip(tensors, names.split("\n")):
            if t.is_inference():  # no version counter
                raise RecomputeError(_message(t, name)) from None
        raise


def _input_versions(tensors: list[torch.Tensor], names: str) -> torch.Tensor:
    """The version counters of ``tensors`` (forward). ``names`` holds one name per
    tensor, one per line."""
    return torch.tensor(_versions(tensors, names), dtype=torch.int64)


def _check_input_versions(grad: torch.Tensor, versions: torch.Tensor, tensors: list[torch.Tensor], names: str) -> None:
    """Raise RecomputeError if one of ``tensors`` was written since ``versions`` was
    taken (backward). ``grad`` (a tangent) is read only to place the op in the backward;
    ``names`` as for ``input_versions``."""
    before, now = versions.tolist(), _versions(tensors, names)
    if now == before:
        return
    for a, b, t, name in zip(before, now, tensors, names.split("\n")):
        if a != b:
            raise RecomputeError(_message(t, name, a, b))


def _fake_versions(tensors: list[torch.Tensor], names: str) -> torch.Tensor:
    return torch.empty(len(tensors), dtype=torch.int64)


def _fake_check(grad: torch.Tensor, versions: torch.Tensor, tensors: list[torch.Tensor], names: str) -> None:
    return None


_LIB.impl("input_versions", _input_versions, "CompositeExplicitAutograd")
_LIB.impl("check_input_versions", _check_input_versions, "CompositeExplicitAutograd")
torch.library.register_fake("gradient_scope::input_versions", _fake_versions, lib=_LIB)
torch.library.register_fake("gradient_scope::check_input_versions", _fake_check, lib=_LIB)


_CHECK = torch.ops.gradient_scope.check_input_versions.default
_VERSIONS = torch.ops.gradient_scope.input_versions.default
torch.fx.node.has_side_effect(_CHECK)
torch.fx.node.has_side_effect(_VERSIONS)  # keeps it in the forward graph (see above)


def _rng_states_counted(functionalize: Any) -> Any:
    """Wrap AOTAutograd's ``functionalize_rng_ops`` (torch/_functorch/partitioners.py).

    It appends the RNG states of the random ops the backward recomputes to the forward's
    saved tensors *after* those saved without a version check, and AOTAutograd counts
    the ones saved without a check by their nodes' meta: then the first ``k`` of ours (k
    RNG states) would be saved with autograd's check, which raises PyTorch's error
    before our check names the parameter. Where the forward saves tensors of ours, its
    RNG states are marked to be saved without a check as well (nobody writes them)."""

    @functools.wraps(functionalize)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        fw, bw = functionalize(*args, **kwargs)
        outputs = next(iter(fw.graph.find_nodes(op="output"))).args[0]
        nodes = [n for n in outputs if isinstance(n, torch.fx.Node)]
        if any(n.meta.get(_NO_VC_CHECK) for n in nodes):
            for n in nodes:
                src = n.args[0] if n.target is operator.getitem and n.args else None
                if isinstance(src, torch.fx.Node) and src.target is _RUN_AND_SAVE_RNG:
                    n.meta[_NO_VC_CHECK] = True
        return fw, bw

    wrapper.__gradient_scope__ = True  # type: ignore[attr-defined]
    return wrapper


_RUN_AND_SAVE_RNG = getattr(getattr(getattr(torch, "_prims", None), "rng_prims", None), "run_and_save_rng_state", None)


def _message(t: torch.Tensor, name: str, before: int | None = None, now: int | None = None) -> str:
    weight = isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad)
    what = f"{'parameter' if weight else 'tensor'} {name + ' ' if name else ''}of shape {list(t.shape)} ({t.dtype})"
    if now is None:
        return (
            f"gradient_scope: the {what}, read by a recompute_scope in compiled code, is an inference "
            "tensor: it has no version counter, so a write to it before backward could not be seen "
            "(autograd does not save inference tensors either). Fix: create it outside "
            "torch.inference_mode(), or use a clone of it."
        )
    return (
        f"gradient_scope: the backward of compiled code with a recompute_scope reads the {what}, which "
        f"was modified in place after the compiled forward (version {before} -> {now}) and before "
        "backward. " + (WEIGHT_UPDATE if weight else INPUT_WRITTEN)
    )


def _source_name(source: str) -> str:
    """``L['self']._modules['lin']._parameters['weight']`` -> ``self.lin.weight``
    (``L['args'][0]...`` -> ``self...`` too)."""
    name = re.sub(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", r".\1", source)
    name = re.sub(r"^[LG]\['([^']*)'\]", r"\1", name)
    # A forward wrapped by a decorator taking ``*args`` (transformers' models) gets its
    # module as args[0]: the method's self.
    return re.sub(r"^args\[0\]\.", "self.", name)


def _dynamo_placeholders() -> list[torch.fx.Node]:
    """The inputs of dynamo's graph being compiled (empty where it is not found)."""
    mod = caller_locals(_SIMPLIFIED, max_depth=24).get("mod")
    graph = mod.graph if isinstance(mod, torch.fx.GraphModule) else torch.fx.Graph()
    return [n for n in graph.nodes if n.op == "placeholder"]


def _user_weights(primals: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The joint-graph inputs that are tensors made to be trained without being
    ``nn.Parameter`` s (``torch.zeros(8, requires_grad=True)``, an argument or a global):
    leaves that require grad. Like parameters they are alive while the graph is (its
    AccumulateGrad nodes hold them), so saving them without autograd's check costs no
    memory; other inputs (activations, data) are not: their saved copies go at backward."""
    placeholders = _dynamo_placeholders()
    weights = set()
    for node in primals:
        desc = node.meta.get("desc")
        idx = getattr(desc, "idx", -1)
        if type(desc).__name__ != "PlainAOTInput" or not 0 <= idx < len(placeholders):
            continue
        example = getattr(placeholders[idx].meta.get("grapharg"), "_example", None)
        tensor = example() if callable(example) else example  # (a TensorWeakRef)
        if isinstance(tensor, torch.Tensor) and tensor.is_leaf and tensor.requires_grad:
            weights.add(node)
    return weights


def _input_names(primals: list[torch.fx.Node]) -> list[str]:
    """A name per joint-graph input: what dynamo read it from, '' where unknown."""
    placeholders = _dynamo_placeholders()
    names = []
    for node in primals:
        desc = node.meta.get("desc")
        kind, idx = type(desc).__name__, getattr(desc, "idx", -1)
        name = ""
        if kind in ("ParamAOTInput", "BufferAOTInput"):
            name = str(getattr(desc, "target", ""))
        elif kind == "PlainAOTInput" and 0 <= idx < len(placeholders):
            source = getattr(placeholders[idx].meta.get("grapharg"), "source", None)
            source_name = getattr(source, "name", "")
            name = _source_name(str(source_name() if callable(source_name) else source_name))
        names.append(name.replace("\n", " "))
    return names


def _read_in_backward(node: torch.fx.Node, backward: set[torch.fx.Node]) -> bool:
    """Whether the backward reads ``node`` (or a view of it): a backward node, or a
    forward node the partitioner recomputes (a block's)."""
    from torch.utils.checkpoint import CheckpointPolicy

    stack, seen = [node], {node}
    while stack:
        for user in stack.pop().users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            if user in backward or user.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE:
                return True
            if is_alias(user):
                stack.append(user)
    return False


def _aliases(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node`` and the views of it (following views of views)."""
    out, stack = [node], [node]
    while stack:
        for user in stack.pop().users:
            if user.op == "call_function" and is_alias(user) and user not in out:
                out.append(user)
                stack.append(user)
    return out


def _cudagraphs_on() -> bool:
    """Whether inductor compiles this graph for CUDA graphs (``mode="reduce-overhead"``),
    which would replay a captured graph without running the version ops' Python."""
    config = sys.modules.get("torch._inductor.config")
    return bool(getattr(getattr(config, "triton", None), "cudagraphs", False))


def _candidates(gm: torch.fx.GraphModule) -> tuple[list[torch.fx.Node], list[torch.fx.Node], list[torch.fx.Node]]:
    """``(primals, tangents, candidates)``: the weights that may be
    checked (no candidates where the inputs are unknown, there is no backward, or CUDA
    graphs replay the graph: autograd's check stays)."""
    from torch._subclasses.fake_tensor import FakeTensor

    frame = caller_locals(_PARTITION)
    info = getattr(frame.get("inner_meta"), "input_info", None)
    static = getattr(frame.get("aot_config"), "static_input_indices", None)
    primals = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
    tangents = [n for n in gm.graph.nodes if n.op == "placeholder" and "tangents" in n.name]
    tangents = [n for n in tangents if isinstance(n.meta.get("val"), FakeTensor)]
    if info is None or static is None or len(info) != len(primals) or not tangents or _cudagraphs_on():
        return primals, tangents, []
    written = written_inputs(gm, list(info))
    weights = _user_weights(primals)
    candidates = [p for i, p in enumerate(primals) if (i in static or p in weights) and p not in written]
    return primals, tangents, [p for p in candidates if isinstance(p.meta.get("val"), FakeTensor)]


def checkable_inputs(gm: torch.fx.GraphModule) -> int:
    """How many weights :func:`guard_input_versions` may check in ``gm``
    (at most): the version check saves one int64 for each."""
    return len(_candidates(gm)[2])


def guard_input_versions(gm: torch.fx.GraphModule, backward: set[torch.fx.Node]) -> int:
    """Check, in the backward, the versions of the weights the backward
    reads (see the module docstring); returns how many are checked so far (the
    partitioner may add the ones it saves for its own recomputations: step 4)."""
    from torch.utils.checkpoint import CheckpointPolicy

    primals, tangents, candidates = _candidates(gm)
    bw_nodes = [n for n in gm.graph.nodes if n in backward and n.op != "placeholder"]
    if not candidates or not bw_nodes:
        return 0
    names = _input_names(primals)
    for p in candidates:
        p.meta[_CANDIDATE] = names[primals.index(p)]
    guarded = [p for p in candidates if _read_in_backward(p, backward)]
    graph = gm.graph
    with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
        versions = graph.call_function(_VERSIONS, ([], ""))
    versions.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    with graph.inserting_before(bw_nodes[0]):
        check = graph.call_function(_CHECK, (tangents[0], versions, [], ""))
    check.meta["val"] = None
    backward.add(check)
    versions.meta["partitioner_tag"] = "is_forward"
    check.meta["partitioner_tag"] = "is_backward"
    versions.meta[_NO_VC_CHECK] = True
    _guard(versions, check, guarded)
    gm.recompile()
    return len(guarded)


def _guard(versions: torch.fx.Node, check: torch.fx.Node, guarded: list[torch.fx.Node]) -> None:
    """Make the version ops read ``guarded`` (views saved in their place are read by the
    check: a view shares its base's version counter), saved without autograd's check."""
    roots = [_root(n) for n in guarded]
    text = "\n".join(r.meta[_CANDIDATE] for r in roots)
    versions.args = (roots, text)
    check.args = (check.args[0], versions, guarded, text)
    fake = next((r.meta["val"] for r in roots), None)
    with fake.fake_mode if fake is not None else contextlib.nullcontext():
        versions.meta["val"] = torch.empty(len(roots), dtype=torch.int64)
    for root in roots:
        for node in _aliases(root):  # saved with autograd's check, a view would raise first
            node.meta[_NO_VC_CHECK] = True


def _root(node: torch.fx.Node) -> torch.fx.Node:
    """The graph input ``node`` is (a view of)."""
    while node.op == "call_function" and is_alias(node) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _saved_inputs_guarded(extract: Any) -> Any:
    """Wrap AOTAutograd's ``_extract_fwd_bwd_modules`` (torch/_functorch/partitioners.py),
    which every partitioner calls with the values it has chosen to save (step 4): a
    parameter or buffer it saves for the backward -- for a recomputation of its own
    outside the blocks, say -- is checked too. In a graph without our version ops,
    nothing changes."""

    @functools.wraps(extract)
    def wrapper(joint_module: torch.fx.GraphModule, saved_values: list[Any], *args: Any, **kwargs: Any) -> Any:
        ops = {n.target: n for n in joint_module.graph.nodes if n.target in (_VERSIONS, _CHECK)}
        versions, check = ops.get(_VERSIONS), ops.get(_CHECK)
        if versions is not None and check is not None:
            guarded = list(check.args[2])
            for v in saved_values:
                if v not in guarded and _CANDIDATE in _root(v).meta and v is not versions:
                    guarded.append(v)
            if guarded:
                _guard(versions, check, guarded)
            else:  # nothing to check: no ops
                saved_values = [v for v in saved_values if v is not versions]
                joint_module.graph.erase_node(check)
                joint_module.graph.erase_node(versions)
        return extract(joint_module, saved_values, *args, **kwargs)

    wrapper.__gradient_scope__ = True  # type: ignore[attr-defined]
    return wrapper


_PATCHES = (("functionalize_rng_ops", _rng_states_counted), ("_extract_fwd_bwd_modules", _saved_inputs_guarded))
for _name, _wrap in _PATCHES:
    _fn = getattr(_partitioners, _name, None)
    if callable(_fn) and not getattr(_fn, "__gradient_scope__", False):
        setattr(_partitioners, _name, _wrap(_fn))
