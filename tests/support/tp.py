"""Probes for tensor-parallel tests (``tests/distributed/test_tp_memory.py``)::

    from support.tp import StorageWatch, CommCount, local_bytes, free_port

* ``StorageWatch``: a dispatch mode that notes the storage of every op's output (a wrapper's
  local tensors: DTensor's, by local bytes); ``held(exclude)`` is the bytes of those still
  alive, each storage once: what forward keeps (autograd's saves, a scope's records);
* ``CommCount``: a dispatch mode counting the collectives that run under it, also those a
  DTensor op runs for its redistributions (it lets DTensor desugar first, as PyTorch's
  ``CommDebugMode`` does) and those a replay runs.
"""

import gc
import socket

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gradient_scope._base.subclass import data_tensors

__all__ = ["StorageWatch", "CommCount", "local_bytes", "free_port"]


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_bytes(t):
    """The bytes of ``t``'s local data (a DTensor's shard)."""
    return sum(d.untyped_storage().nbytes() for d in data_tensors(t))


class StorageWatch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = {}  # data address -> (weak storage, bytes); a reused address is the newest

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for d in data_tensors(t):
                    s = d.untyped_storage()
                    if s.nbytes():
                        self.seen[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        return out

    def held(self, exclude=()):
        """Bytes of the noted storages alive now, but those of ``exclude`` (tensors)."""
        gc.collect()
        skip = {d.untyped_storage().data_ptr() for t in exclude for d in data_tensors(t)}
        return sum(n for p, (ref, n) in self.seen.items() if not ref.expired() and p not in skip)


_COMM_NAMESPACES = ("_c10d_functional", "c10d", "c10d_functional")


class CommCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor runs its local ops (and collectives) under this mode
        ns = func.namespace if hasattr(func, "namespace") else ""
        if ns in _COMM_NAMESPACES and "wait" not in func.__name__ and "wrap" not in func.__name__:
            self.n += 1
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))
