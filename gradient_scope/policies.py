"""Ready-made ``save=`` policies for :class:`~gradient_scope.recompute_scope`.

A save policy tells a scope which operations' outputs to *store* for backward
instead of recomputing them (selective recompute). The scope calls it once per
distinct op it sees, with an ``OpOverload`` such as
``torch.ops.aten.mm.default``; ops for which it returns True run as usual and
their outputs are kept, and the rest of the block is recomputed from them.

Typical use: keep the expensive matmuls, recompute the cheap elementwise ops
(GELU, LayerNorm, softmax, dropout, ...) around them::

    from gradient_scope import recompute_scope
    from gradient_scope.policies import save_matmuls

    with recompute_scope(save=save_matmuls):
        h = mlp(x)

Policies are plain picklable callables ``policy(op) -> bool``; combine them,
and add single ops, with :func:`save_any`. Overloads that write to an argument
(in-place and ``out=`` variants such as ``aten.addmm_`` or ``aten.mm.out``)
never match the named policies below: their writes are left to the scope to
record.

A policy can also see where and what the op is: mark it with
:func:`context_policy` and it is called with an :class:`OpContext` per op call
(the module path the op runs under, its arguments' and outputs' shapes and dtypes,
the name of the :func:`name_region` it runs in) instead of the op alone::

    @context_policy
    def save_early_attention(ctx: OpContext) -> bool:     # layers 0-3 only
        return save_attention(ctx.op) and ctx.layer is not None and ctx.layer < 4
"""

from __future__ import annotations

import contextlib
import importlib
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ._base.torch_compat import OpOverload, OpOverloadPacket, op_overload_name, op_qualified_name, op_schema

__all__ = [
    "save_nothing",
    "save_matmuls",
    "save_attention",
    "save_any",
    "context_policy",
    "ContextPolicy",
    "OpContext",
    "name_region",
    "region_name",
    "as_save_policy",
    "BUILT_IN",
    "is_built_in",
    "NAME_KEY",
]


# Op names (without the ``aten::`` namespace) matched by the policies. Most
# users only ever meet the first few: a dispatch-level view of a model sees
# ``mm``/``addmm``/``bmm`` for ``nn.Linear``/``matmul``/``einsum``, ``convolution``
# for every ``nn.Conv*d``, and one ``_scaled_dot_product_*attention*`` kernel for
# ``F.scaled_dot_product_attention``. The composite names (``linear``,
# ``matmul``, ``conv2d``, ...) are listed so that a policy also says the
# expected thing when asked about them directly.
_MATMUL_OPS = frozenset(
    {
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "addbmm",
        "addmv",
        "mv",
        "dot",
        "vdot",
        "matmul",
        "linear",
        "bilinear",
        "einsum",
        "tensordot",
        "chain_matmul",
        "_addmm_activation",
        "_int_mm",
        "_scaled_mm",
        "_scaled_mm_v2",
        "_grouped_mm",
        "_scaled_grouped_mm",
        "_weight_int8pack_mm",
        "_weight_int4pack_mm",
        "_weight_int4pack_mm_for_cpu",
        "_weight_int4pack_mm_with_scales_and_zeros",
        "_dyn_quant_matmul_4bit",
        "_mixed_dtypes_linear",
        "_sparse_semi_structured_linear",
        "_sparse_semi_structured_mm",
        "_sparse_semi_structured_addmm",
        "_cslt_sparse_mm",
        "mkldnn_linear",
    }
)

_CONVOLUTION_OPS = frozenset(
    {
        "convolution",
        "_convolution",
        "_convolution_mode",
        "convolution_overrideable",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "conv_tbc",
        "mkldnn_convolution",
        "cudnn_convolution",
        "cudnn_convolution_transpose",
        "cudnn_convolution_relu",
        "cudnn_convolution_add_relu",
        "miopen_convolution",
        "miopen_convolution_transpose",
        "miopen_depthwise_convolution",
        "_slow_conv2d_forward",
        "slow_conv3d_forward",
        "slow_conv_dilated2d",
        "slow_conv_dilated3d",
        "slow_conv_transpose2d",
        "slow_conv_transpose3d",
        "thnn_conv2d",
        "_conv_depthwise2d",
        "conv_depthwise3d",
        "_nnpack_spatial_convolution",
    }
)

_ATTENTION_RE = re.compile(r"_?scaled_dot_product_\w*attention\w*")
_ATTENTION_EXTRA = frozenset(
    {
        "_flash_attention_forward",
        "_efficient_attention_forward",
        "_native_multi_head_attention",
    }
)


def _aten_name(op: Any) -> str | None:
    """``"mm"`` for ``torch.ops.aten.mm.default``; None for non-aten ops and for
    overloads that write to one of their arguments (in-place / ``out=``)."""
    schema = op_schema(op)
    if schema is not None:
        if schema.is_mutable:
            return None
        qualified = schema.name
    else:  # an OpOverloadPacket, if someone asks about one
        qualified = op_qualified_name(op)
        if not isinstance(qualified, str):
            return None
    namespace, sep, name = str(qualified).partition("::")
    if not sep or namespace != "aten":
        return None
    return name


def _is_attention(name: str) -> bool:
    if name in _ATTENTION_EXTRA:
        return True
    return _ATTENTION_RE.fullmatch(name) is not None and not name.endswith("_backward")


def save_nothing(op: Any) -> bool:
    """Store nothing: recompute every tensor the block creates.

    The same as leaving ``save=`` out; useful where a policy must be named
    (e.g. a config value, or a default in your own helper).

    Example::

        >>> import torch
        >>> from gradient_scope import recompute_scope, save_nothing
        >>> save_nothing(torch.ops.aten.mm.default)
        False
        >>> w = torch.randn(8, 8, requires_grad=True)
        >>> with recompute_scope(save=save_nothing):
        ...     h = (w @ w).relu()
        >>> (h * h).sum().backward()
    """
    return False


def save_attention(op: Any) -> bool:
    """Store the outputs of fused attention kernels, recompute everything else.

    True for the ``aten._scaled_dot_product_*attention*`` kernels that
    ``torch.nn.functional.scaled_dot_product_attention`` runs (flash, memory
    efficient, cuDNN, CPU flash, ...), ``_flash_attention_forward``,
    ``_efficient_attention_forward`` and ``_native_multi_head_attention``.
    Attention is the most expensive op of a transformer block to recompute and
    its output is small (``B x T x C``): storing it and recomputing the rest is
    a good trade.

    Example::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> from gradient_scope import recompute_scope, save_attention
        >>> save_attention(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
        True
        >>> save_attention(torch.ops.aten.mm.default)
        False
        >>> q = torch.randn(2, 4, 16, 8, requires_grad=True)
        >>> with recompute_scope(save=save_attention):
        ...     y = F.scaled_dot_product_attention(q.sin(), q.cos(), q, is_causal=True)
        >>> y.sum().backward()
    """
    name = _aten_name(op)
    return name is not None and _is_attention(name)


def save_matmuls(op: Any) -> bool:
    """Store the outputs of matmuls, attention kernels and convolutions.

    True for the matrix-multiply family (``mm``, ``bmm``, ``addmm``,
    ``baddbmm``, ``addbmm``, ``addmv``, ``mv``, ``dot``, ``matmul``,
    ``linear``, ``einsum``, the int8/int4/fp8 ``*_mm`` kernels, ...), for the
    fused attention kernels (see :func:`save_attention`) and for convolutions
    (``convolution`` and its backend variants). These are the ops that cost
    FLOPs; the elementwise and normalisation ops between them (GELU,
    LayerNorm, softmax, dropout, residual adds) are cheap and are recomputed.
    With ``nn.Linear`` layers this keeps each layer's output and recomputes
    activations such as ``gelu(fc1(x))`` from it.

    Only ``aten`` ops match, and never an in-place or ``out=`` overload.

    Example::

        >>> import torch
        >>> import torch.nn as nn
        >>> from gradient_scope import recompute_scope, save_matmuls
        >>> save_matmuls(torch.ops.aten.addmm.default), save_matmuls(torch.ops.aten.gelu.default)
        (True, False)
        >>> mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16))
        >>> x = torch.randn(4, 16)
        >>> with recompute_scope(save=save_matmuls):
        ...     y = mlp(x)     # fc outputs stored; GELU and LayerNorm recomputed
        >>> y.pow(2).sum().backward()
    """
    name = _aten_name(op)
    if name is None:
        return False
    return name in _MATMUL_OPS or name in _CONVOLUTION_OPS or _is_attention(name)


#: The ready-made op policies: one that matches no op of a block warns once (the
#: model may not run the ops it names, e.g. attention that is no SDPA kernel).
BUILT_IN: tuple[Callable[[Any], bool], ...] = (save_matmuls, save_attention)


def is_built_in(policy: Any) -> bool:
    """Whether ``policy`` is one of :data:`BUILT_IN` (by identity: a user's policy may not hash)."""
    return any(policy is p for p in BUILT_IN)


# ------------------------------------------------------------------ where and what


#: The key of a region name in a compiled graph's node annotation (``node.meta["custom"]``).
NAME_KEY = "gradient_scope_name"

_regions = threading.local()


def region_name() -> str | None:
    """The name of the innermost :func:`name_region` running in this thread (eager code)."""
    names: list[str] | None = getattr(_regions, "names", None)
    return names[-1] if names else None


@contextlib.contextmanager
def name_region(name: str) -> Iterator[None]:
    """Name the ops run inside the ``with`` block, for context policies (``ctx.name``).

    Nothing else changes: outside a scope, or in a scope whose policy does not look at
    names, it has no effect. Regions nest (``ctx.name`` is the innermost one's). Name
    the lines that make the tensors you may want to keep, once, in the model; choose
    what to keep with the policy, without touching the model again. Under
    ``torch.compile`` the name is an annotation of the graph's nodes
    (``torch.fx.traceback.annotate``), seen by context policies there too.

    Example::

        >>> import torch
        >>> from gradient_scope import recompute_scope
        >>> from gradient_scope.policies import context_policy, name_region
        >>> @context_policy
        ... def keep_scores(ctx):
        ...     return ctx.name == "scores"
        >>> q = torch.randn(4, 8, requires_grad=True)
        >>> with recompute_scope(save=keep_scores) as scope:
        ...     k = q.t()
        ...     with name_region("scores"):
        ...         s = q @ k              # stored: its op ran in the region "scores"
        ...     p = s.softmax(-1)          # recomputed
        >>> scope.stats.ops_saved
        1
    """
    if not isinstance(name, str):
        raise TypeError(f"name_region: name must be a str, got {type(name).__name__}")
    if torch.compiler.is_compiling():
        import torch.fx.traceback as fx_traceback

        annotate = getattr(fx_traceback, "annotate", None)  # torch >= 2.13; before, scopes run eagerly
        if annotate is not None:
            with annotate({NAME_KEY: name}):
                yield
            return
    names: list[str] | None = getattr(_regions, "names", None)
    if names is None:
        names = _regions.names = []
    names.append(name)
    try:
        yield
    finally:
        names.pop()


def _shape(t: Any) -> torch.Size | None:
    return t.shape if isinstance(t, torch.Tensor) else None


class OpContext:
    """What a :func:`context_policy` sees of one op call: where it runs and what it makes.

    Attributes:
        op: the op (an ``OpOverload`` such as ``torch.ops.aten.mm.default``).
        name: the name of the innermost :func:`name_region` the op runs in, or None.

    Read it during the call: the properties below look at the running op (the module
    path at the stack of running modules), which is gone once the policy returns.
    """

    __slots__ = ("op", "name", "_args", "_outs", "_path")

    def __init__(self, op: Any, args: Any, out: Any, name: str | None, path: str | Callable[[], str]) -> None:
        self.op = op
        self.name = name
        self._args = args
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self._outs = tuple(o for o in outs if isinstance(o, torch.Tensor))
        self._path = path

    @property
    def module_path(self) -> str:
        """The path of the innermost module whose forward runs the op, as
        ``named_modules()`` of the outermost running module names it
        (``"layers.3.self_attn"``; ``""`` for the outermost module itself and outside
        any module). Under ``torch.compile``: from the node's ``nn_module_stack``, relative
        to the outermost module the compiled code calls."""
        path = self._path
        if not isinstance(path, str):
            path = self._path = path()
        return path

    @property
    def layer(self) -> int | None:
        """The first number in :attr:`module_path` (``3`` in ``"model.layers.3.mlp"``): the
        index of the layer in its ``ModuleList``; None if there is none."""
        for part in self.module_path.split("."):
            if part.isdigit():
                return int(part)
        return None

    @property
    def arg_shapes(self) -> tuple[torch.Size | None, ...]:
        """The shape of each positional argument (None for one that is not a tensor)."""
        return tuple(_shape(a) for a in self._args)

    @property
    def arg_dtypes(self) -> tuple[torch.dtype | None, ...]:
        """The dtype of each positional argument (None for one that is not a tensor)."""
        return tuple(a.dtype if isinstance(a, torch.Tensor) else None for a in self._args)

    @property
    def out_shapes(self) -> tuple[torch.Size, ...]:
        """The shape of each tensor the op returned."""
        return tuple(o.shape for o in self._outs)

    @property
    def out_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtype of each tensor the op returned."""
        return tuple(o.dtype for o in self._outs)

    @property
    def out_bytes(self) -> int:
        """The bytes of the tensors the op returned (numel x element size, summed)."""
        return sum(o.numel() * o.element_size() for o in self._outs)

    def release(self) -> None:
        """Drop the references to the op's tensors (after the policy returned)."""
        self._args, self._outs = (), ()

    def __repr__(self) -> str:
        return f"OpContext(op={self.op}, name={self.name!r}, out_shapes={[list(s) for s in self.out_shapes]})"


class ContextPolicy:
    """A ``save=`` policy called with an :class:`OpContext` per op call (made by
    :func:`context_policy`). Picklable when its function is."""

    __slots__ = ("fn", "__weakref__")

    def __init__(self, fn: Callable[[OpContext], bool]) -> None:
        if not callable(fn):
            raise TypeError(f"context_policy: expected a callable ctx -> bool, got {type(fn).__name__}")
        self.fn = fn

    def __call__(self, ctx: OpContext) -> bool:
        return bool(self.fn(ctx))

    @property
    def __wrapped__(self) -> Callable[[OpContext], bool]:
        return self.fn

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", None) or repr(self.fn)
        return f"context_policy({name})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ContextPolicy) and self.fn == other.fn

    def __hash__(self) -> int:
        return hash(self.fn)

    def __reduce__(self) -> Any:
        # A decorated module-level function: its name now refers to this object.
        module, name = getattr(self.fn, "__module__", None), getattr(self.fn, "__qualname__", "")
        if isinstance(module, str) and _by_name(module, name) is self:
            return (_by_name, (module, name))
        return (ContextPolicy, (self.fn,))


def _by_name(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def context_policy(fn: Callable[[OpContext], bool]) -> ContextPolicy:
    """Mark ``fn`` as a policy that takes an :class:`OpContext` (where and what the op is).

    A plain ``save(op)`` policy is asked once per distinct op of a block and its answer
    reused; a context policy is asked at every op call, after the op has run (it sees
    the outputs), which costs a Python call per op of the block. The module path is
    looked up only when the policy reads it: test the op first. Ops that write to an
    argument are always recorded and never asked about. Under ``torch.compile`` it is
    asked once per node of the graph, when the graph is compiled: the module path comes
    from the node's ``nn_module_stack``, shapes from its example values (sizes of the
    first input seen, with dynamic shapes), the name from :func:`name_region`.

    Example::

        >>> import torch
        >>> import torch.nn as nn
        >>> from gradient_scope import apply_recompute, model_stats
        >>> from gradient_scope.policies import OpContext, context_policy, save_matmuls
        >>> @context_policy
        ... def big_matmuls(ctx: OpContext) -> bool:     # matmul outputs over 16 KiB
        ...     return save_matmuls(ctx.op) and ctx.out_bytes > 16 * 1024
        >>> model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 32)) for _ in range(2)))
        >>> _ = apply_recompute(model, check_fn=lambda m: m in list(model), save=big_matmuls)
        >>> model(torch.randn(64, 32)).sum().backward()   # each 64 x 256 fc1 output is stored
        >>> model_stats(model).modules["0"].ops_saved
        1
    """
    return fn if isinstance(fn, ContextPolicy) else ContextPolicy(fn)


# ------------------------------------------------------------------ combining


def _op_key(op: Any) -> tuple[str, str | None]:
    """(qualified name, overload name or None for a packet): a picklable op name."""
    if isinstance(op, OpOverload):
        return op_schema(op).name, op_overload_name(op)
    return op_qualified_name(op), None


def _op_from_key(qualified: str, overload: str | None) -> Any:
    namespace, _, name = qualified.partition("::")
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


class _SaveAny:
    """The policy :func:`save_any` returns (picklable: ops are pickled by name)."""

    __slots__ = ("policies", "overloads", "packets")

    def __init__(self, policies: tuple[Callable[[Any], bool], ...], ops: tuple[Any, ...]) -> None:
        self.policies = policies
        self.overloads = frozenset(op for op in ops if isinstance(op, OpOverload))
        self.packets = frozenset(op for op in ops if isinstance(op, OpOverloadPacket))

    def __call__(self, op: Any) -> bool:
        if op in self.overloads:
            return True
        if self.packets and getattr(op, "overloadpacket", op) in self.packets:
            return True
        return any(p(op) for p in self.policies)

    def _items(self) -> list[Any]:
        ops = sorted((*self.packets, *self.overloads), key=str)
        return [*self.policies, *ops]

    def __repr__(self) -> str:
        def name(x: Any) -> str:
            if isinstance(x, (OpOverload, OpOverloadPacket)):
                return f"torch.ops.{x}"
            return getattr(x, "__qualname__", None) or repr(x)

        return f"save_any({', '.join(name(x) for x in self._items())})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _SaveAny):
            return NotImplemented
        return (self.policies, self.overloads, self.packets) == (
            other.policies,
            other.overloads,
            other.packets,
        )

    def __hash__(self) -> int:
        return hash((self.policies, self.overloads, self.packets))

    def __reduce__(self) -> Any:
        keys = tuple(sorted(_op_key(op) for op in (*self.packets, *self.overloads)))
        return (_rebuild_save_any, (self.policies, keys))


def _rebuild_save_any(policies: tuple[Any, ...], keys: tuple[tuple[str, str | None], ...]) -> _SaveAny:
    return _SaveAny(policies, tuple(_op_from_key(*k) for k in keys))


def save_any(*items: Any) -> Callable[[Any], bool]:
    """Combine policies and ops: store an op's outputs if any item says so.

    Each item is a policy (a callable ``op -> bool``, such as
    :func:`save_matmuls`, or a :func:`context_policy`), an op packet
    (``torch.ops.aten.gelu``: every overload) or a single overload
    (``torch.ops.aten.gelu.default``). The result is a policy for
    ``recompute_scope(save=...)`` (a context policy if any item is one); it
    pickles as long as its policies do (ops are pickled by name).

    Example::

        >>> import torch
        >>> from gradient_scope import recompute_scope, save_any, save_matmuls
        >>> policy = save_any(save_matmuls, torch.ops.aten.gelu)
        >>> policy(torch.ops.aten.gelu.default), policy(torch.ops.aten.mm.default)
        (True, True)
        >>> policy(torch.ops.aten.tanh.default)
        False
        >>> w = torch.randn(8, 8, requires_grad=True)
        >>> with recompute_scope(save=policy):
        ...     h = torch.nn.functional.gelu(w @ w).tanh()   # only tanh is recomputed
        >>> (h * h).sum().backward()
    """
    policies: list[Callable[[Any], bool]] = []
    ops: list[Any] = []
    contextual = [item for item in items if isinstance(item, ContextPolicy)]
    if contextual:  # a context policy among them: the result takes an OpContext
        rest = save_any(*(item for item in items if not isinstance(item, ContextPolicy)))
        return ContextPolicy(_AnyContext(rest, tuple(contextual)))
    for item in items:
        if isinstance(item, (OpOverload, OpOverloadPacket)):
            ops.append(item)
        elif isinstance(item, _SaveAny):
            policies.extend(item.policies)
            ops.extend(item.packets)
            ops.extend(item.overloads)
        elif callable(item):
            policies.append(item)
        else:
            raise TypeError(
                "save_any: each item must be a policy (a callable op -> bool) or an op such as "
                f"torch.ops.aten.mm or torch.ops.aten.mm.default, got {item!r}"
            )
    return _SaveAny(tuple(policies), tuple(ops))


class _AnyContext:
    """``save_any`` of op policies (asked with ``ctx.op``) and context policies."""

    __slots__ = ("ops", "contextual")

    def __init__(self, ops: Callable[[Any], bool], contextual: tuple[ContextPolicy, ...]) -> None:
        self.ops, self.contextual = ops, contextual

    def __call__(self, ctx: OpContext) -> bool:
        return self.ops(ctx.op) or any(p(ctx) for p in self.contextual)

    def __repr__(self) -> str:
        return f"{self.ops!r} + {', '.join(map(repr, self.contextual))}"


_OPS = (OpOverload, OpOverloadPacket)


def as_save_policy(save: Iterable[Any] | Callable[[Any], bool] | None) -> Callable[[Any], bool] | None:
    """The ``save=`` option of a scope as a policy ``op -> bool`` (None: recompute everything).

    The one place ``save=`` is interpreted: a callable (a :class:`ContextPolicy` too)
    is used as it is; an op, or an iterable of ops (``torch.ops.aten.mm`` or
    ``torch.ops.aten.mm.default``), becomes a picklable :func:`save_any` policy.

    Example::

        >>> import torch
        >>> from gradient_scope.policies import as_save_policy
        >>> policy = as_save_policy([torch.ops.aten.mm])
        >>> policy(torch.ops.aten.mm.default), policy(torch.ops.aten.add.Tensor)
        (True, False)
        >>> as_save_policy(None) is None
        True
    """
    if save is None:
        return None
    if isinstance(save, _OPS):
        return _SaveAny((), (save,))
    if callable(save):
        return save
    if isinstance(save, (str, bytes)) or not isinstance(save, Iterable):
        raise TypeError(
            "recompute_scope: save= takes an iterable of ops (e.g. [torch.ops.aten.mm]) "
            f"or a callable op -> bool, got {type(save).__name__}"
        )
    ops = tuple(save)
    for op in ops:
        if not isinstance(op, _OPS):
            raise TypeError(
                "recompute_scope: save= entries must be ops such as torch.ops.aten.mm or "
                f"torch.ops.aten.mm.default, got {op!r}"
            )
    return _SaveAny((), ops)
