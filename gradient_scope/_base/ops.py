"""Op facts: what an op writes, which outputs alias which argument, whether it
draws random numbers, and whether it may be replayed at all (collectives, and the ops
whose outputs decide shapes or routing: :func:`kept_always`). One place; cached per
``OpOverload``."""

from __future__ import annotations

from typing import Any

import torch

from .torch_compat import SEEDED_TAG, get_alias_info, op_schema, overload_kernel

__all__ = ["OpFacts", "facts", "kept_always", "NEW", "INPLACE", "VIEW"]

#: Output kinds: a fresh tensor, an argument the op wrote and returns, a view
#: of an argument.
NEW, INPLACE, VIEW = 0, 1, 2

# Ops that write to their running-statistics arguments without saying so in
# their schema, and without bumping the arguments' version counters.
_HIDDEN_WRITES: dict[str, tuple[int, ...]] = {
    "aten::native_batch_norm": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
    "aten::_batch_norm_impl_index": (3, 4),
    "aten::_native_batch_norm_legit": (3, 4),
    "aten::_batch_norm_with_update": (3, 4),
}
# Outputs that are kernel scratch space (RNN workspaces): their bytes differ from
# run to run while every other output is equal, so debug=True does not compare them.
_SCRATCH_OUTPUTS: dict[str, tuple[int, ...]] = {
    "aten::mkldnn_rnn_layer": (3,),
    "aten::_cudnn_rnn": (3,),
    "aten::miopen_rnn": (3,),
}
# Ops whose results share their first argument's storage although the schema
# does not mark them as aliases; they get version counters of their own.
_HIDDEN_VIEWS = frozenset(
    {
        "aten::_unsafe_view",
        "aten::_reshape_alias",
        "aten::unsafe_split",
        "aten::unsafe_split_with_sizes",
        "aten::unsafe_chunk",
    }
)

# Collectives replayed in backward can hang or corrupt data when ranks replay
# in different orders: their outputs are stored, never recomputed.
_NEVER_REPLAY_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})
# Functional collectives (``_c10d_functional``) an eager block records and replays whole
# (R11 [ a functional collective replays whole ] in ``_record.entry``; compiled graphs keep
# them), and the op that wraps a result in an ``AsyncCollectiveTensor``: no communication.
_FUNCTIONAL_COLLECTIVES = frozenset(
    {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast"}
)
_FUNCTIONAL_WRAPS = frozenset({"_wrap_tensor_autograd"})

# Ops whose outputs decide shapes or routing: which elements a selection or an ordering
# picked, where the nonzeros are, counts and buckets, unique values, values read to the
# host (``.item()``, ``.tolist()``). Besides these, every aten op with a return named
# ``indices`` (topk, sort, max.dim, min.dim, kthvalue, mode, median.dim, cummax, ...).
# A replay of one may choose differently from forward (a tie broken another way, an
# input written unseen) and the ops it feeds (a MoE's dispatch and combine) would then
# route differently, or take another shape, than the forward the gradients flow through:
# their outputs are stored, never recomputed (R2 [ kept ops are not recorded ] in
# ``_record.entry``), whatever a
# ``save=`` policy says. They are small: indices and counts, not activations.
_ROUTING = frozenset(
    {
        "aten::argmax",
        "aten::argmin",
        "aten::argsort",
        "aten::nonzero",
        "aten::nonzero_static",
        "aten::nonzero_numpy",
        "aten::argwhere",
        "aten::bincount",
        "aten::histc",
        "aten::histogram",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::unique_dim_consecutive",
        "aten::searchsorted",
        "aten::bucketize",
        "aten::_local_scalar_dense",
    }
)
# Copies whose destination may be the host: a device-to-host copy is a value read to the
# host (decided per call by :func:`kept_always`).
_COPIES = frozenset({"aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize"})

# Factories that read only the metadata (shape, dtype, device) of argument 0.
_META_ONLY = frozenset(
    {
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
    }
)


# Ops whose results depend on global flags (oneDNN / cuDNN on or off, TF32 and
# matmul precision, deterministic algorithms, filling uninitialised memory): the
# recorder re-reads the numeric context before recording one (substrings of the
# aten name; R9 [ each op's numeric context ] in ``_record.entry``). Over-inclusion costs a few
# microseconds per op, never correctness.
_CONTEXT_OPS = (
    "conv", "mm", "matmul", "linear", "addmv", "mv", "dot", "addr", "einsum", "rnn", "lstm", "gru",
    "attention", "sdp", "index_put", "index_add", "index_copy", "index_reduce", "scatter", "put",
    "cumsum", "cumprod", "empty", "resize", "histc", "bincount", "kthvalue", "median", "nll_loss",
    "embedding", "ctc", "upsample", "pool", "grid_sampler", "batch_norm", "_scaled", "tensordot",
)  # fmt: skip


AliasSets = list[tuple[frozenset[str], bool]]


def _alias_sets(func: Any) -> tuple[AliasSets, AliasSets]:
    """(alias set, is written) of each argument and each return of ``func``."""
    try:
        info = get_alias_info(func)
        return (
            [(frozenset(a.alias_set), a.is_write) for a in info.args],
            [(frozenset(a.alias_set), a.is_write) for a in info.outs],
        )
    except Exception:  # noqa: BLE001  (a schema torchgen cannot parse: read the TorchScript one)
        schema = op_schema(func)

        def sets(items: Any) -> AliasSets:
            return [
                (
                    frozenset(x.alias_info.before_set) if x.alias_info else frozenset(),
                    bool(x.alias_info and x.alias_info.is_write),
                )
                for x in items
            ]

        return sets(schema.arguments), sets(schema.returns)


class OpFacts:
    """What the recorder and replay need to know about one op overload."""

    __slots__ = (
        "name",
        "seeded",
        "writes",
        "outs",
        "view_args",
        "never_replay",
        "uninitialized",
        "meta_only",
        "dtype_arg",
        "fast",
        "context",
        "scratch",
        "loose",
        "kernel",
        "func",
        "view_of",
        "routing",
        "host_copy",
        "collective",
    )

    def __init__(self, func: Any) -> None:
        schema = op_schema(func)
        self.func = func  # keeps its id, the key of _FACTS, from being reused
        self.kernel = overload_kernel(func)  # what the hot path calls
        self.name: str = schema.name
        namespace, _, short = schema.name.partition("::")
        self.routing = namespace == "aten" and (
            schema.name in _ROUTING or any(r.name == "indices" for r in schema.returns)
        )
        self.never_replay = (namespace in _NEVER_REPLAY_NAMESPACES and short not in _FUNCTIONAL_WRAPS) or self.routing
        self.host_copy = schema.name in _COPIES
        self.seeded = SEEDED_TAG in func.tags
        aten = namespace == "aten"
        self.uninitialized = aten and (short.startswith("empty") or short.startswith("new_empty"))
        self.scratch: tuple[int, ...] = _SCRATCH_OUTPUTS.get(schema.name, ())
        # Its outputs alias an argument with version counters of their own.
        self.loose = schema.name in _HIDDEN_VIEWS
        self.meta_only = aten and (short in _META_ONLY or short.startswith("randint_like"))
        self.context = not aten or any(k in short for k in _CONTEXT_OPS)

        args, outs = _alias_sets(func)
        # Where each schema argument arrives: a position, or a keyword if kwarg-only.
        where: list[int | str] = [a.name if a.kwarg_only else i for i, a in enumerate(schema.arguments)]
        writes: list[int | str] = [where[i] for i, (_, w) in enumerate(args) if w]
        for i in _HIDDEN_WRITES.get(schema.name, ()):
            if i not in writes:
                writes.append(i)
        self.writes: tuple[int | str, ...] = tuple(writes)

        kinds: list[int] = []
        view_args: list[int | str] = []
        for out_set, out_write in outs:
            owner = next((where[i] for i, (s, _) in enumerate(args) if s & out_set), 0)
            if not out_set:
                kinds.append(VIEW if schema.name in _HIDDEN_VIEWS else NEW)
            else:
                kinds.append(INPLACE if out_write else VIEW)
            view_args.append(owner)
        self.outs: tuple[int, ...] = tuple(kinds)
        self.view_args: tuple[int | str, ...] = tuple(view_args)
        # A functional collective returning new tensors: the recorder records it, and a replay
        # runs it again (``_record.wrappers.Collective``); compiled graphs keep it (never_replay).
        self.collective = namespace == "_c10d_functional" and short in _FUNCTIONAL_COLLECTIVES and not self.writes
        # ``dtype=None`` resolves the default dtype when the op runs: the
        # recorder fills in the dtype forward resolved.
        self.dtype_arg = any(a.name == "dtype" and a.kwarg_only for a in schema.arguments)
        # The recorder's hot path (``_record.recorder``) takes the ops with no writes, no randomness
        # and no dtype to resolve, that return one Tensor: a fresh one (``view_of == -1``)
        # or a view of the positional argument ``view_of``.
        one_tensor = len(schema.returns) == 1 and schema.returns[0].type.kind() == "TensorType"
        self.view_of = view_args[0] if kinds == [VIEW] and isinstance(view_args[0], int) else -1
        self.fast = (
            one_tensor
            and (self.outs == (NEW,) or self.view_of >= 0)
            and not self.writes
            and not self.seeded
            and not self.never_replay
            and not self.meta_only
            and not self.dtype_arg
            and not self.host_copy
        )

    def out_kind(self, i: int) -> int:
        """The kind of output ``i`` (ops returning ``Tensor[]`` have one schema return)."""
        kinds = self.outs
        return kinds[i] if i < len(kinds) else (kinds[0] if kinds else NEW)

    def view_arg(self, i: int) -> int | str:
        args = self.view_args
        return args[i] if i < len(args) else (args[0] if args else 0)


# By id(func): an OpOverload hashes in Python (one more frame per recorded op).
_FACTS: dict[int, OpFacts] = {}


def facts(func: Any) -> OpFacts:
    """The facts of an ``OpOverload`` (cached)."""
    f = _FACTS.get(id(func))
    if f is None:
        f = _FACTS[id(func)] = OpFacts(func)
    return f


def _is_host(device: Any) -> bool:
    return torch.device(device).type == "cpu"


def kept_always(f: OpFacts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call's outputs are stored, never recomputed, whatever ``save=`` says:
    a collective, an op whose outputs decide shapes or routing (``f.routing``), or a copy
    from a device to the host (a value read to the host). The one predicate the recorder
    (R2 [ kept ops are not recorded ] in ``_record.entry``) and the steady state's first, recorded
    run both follow.

    Example::

        >>> import torch
        >>> x = torch.randn(4, 8)
        >>> kept_always(facts(torch.ops.aten.topk.default), (x, 2), {})
        True
        >>> kept_always(facts(torch.ops.aten._to_copy.default), (x,), {"device": "cpu"})  # host to host
        False
    """
    if f.never_replay:
        return True
    if not f.host_copy:
        return False
    if f.name == "aten::_to_copy":
        src, dst = (args[0] if args else None), kwargs.get("device")
    else:  # copy_(self, src) and the like: the destination is argument 0
        out = args[0] if args else None
        src, dst = (args[1] if len(args) > 1 else kwargs.get("src")), getattr(out, "device", None)
    if not isinstance(src, torch.Tensor) or dst is None:
        return False
    return _is_host(dst) and src.device.type not in ("cpu", "meta")
