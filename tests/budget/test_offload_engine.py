"""The offload engine (``gradient_scope._budget.offload``, rules O1..O7) on its own, under a
plain saved-tensor hook pair that offloads every saved tensor.

On CPU the engine runs on the host-copy stand-in (``_budget.streams.HostCopyStandIn``):
side streams queue their copies and run them only when something waits, and fresh
"device" buffers hold all bits set (NaN), so a missing wait or a source freed too early
shows in the gradients or raises. On CUDA the same tests run on real streams.
"""

import contextlib
import gc
import itertools
import weakref

import pytest
import torch
import torch.nn.functional as F

from gradient_scope._budget import streams
from gradient_scope._budget.hostpool import footprint
from gradient_scope._budget.offload import Offloaded, Offloader, evict, restore
from gradient_scope._budget.streams import HostCopyStandIn, host_copy_stand_in

from support import DEVICES


@contextlib.contextmanager
def backend(device):
    if device == "cpu":
        with host_copy_stand_in() as b:
            yield b
    else:
        yield None


def offload_all(engine, log=None):
    """A hook pair offloading every saved tensor; keys number the saves of a step."""
    counter = itertools.count()

    def pack(t):
        key = next(counter)
        p = engine.pack(t, key)
        if log is not None:
            log.append(("pack", key, p is not None))
        return p if p is not None else t

    def unpack(p):
        return p.unpack() if isinstance(p, Offloaded) else p

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def mlp_params(device, d=16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(d, d, generator=g).to(device).requires_grad_() for _ in range(3)]


def mlp(x, ws):
    h = x
    for w in ws:
        h = F.gelu(h @ w.t()).tanh()  # w.t(): a saved view of a parameter
        h = h[:, 1:].sum(1, keepdim=True) * h  # slices: saved views
    return h.square().sum()


def grads(x, ws, hooks=None):
    for t in (x, *ws):
        t.grad = None
    with hooks if hooks is not None else contextlib.nullcontext():
        loss = mlp(x, ws)
    loss.backward()
    return [t.grad.clone() for t in (x, *ws)]


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_bitwise_with_every_saved_tensor_offloaded(device):
    ws = mlp_params(device)
    x = torch.randn(8, 16, device=device, requires_grad=True)
    ref = grads(x, ws)
    with backend(device) as b:
        engine = Offloader(host_limit=None)
        for _ in range(3):
            engine.new_step()
            assert same(grads(x, ws, offload_all(engine)), ref)
        if b is not None:
            assert b.copies > 0 and b.pending() == 0
    assert engine.live_bytes == 0 and engine.in_flight == 0


@pytest.mark.parametrize("device", DEVICES)
def test_views_of_one_storage_share_one_host_copy_and_keep_their_strides(device):
    with backend(device):
        engine = Offloader(host_limit=None)
        base = torch.randn(6, 8, device=device)
        v1, v2 = base.t(), base[2:, 1:]
        p1, p2 = engine.pack(v1, "a"), engine.pack(v2, "b")
        assert p1.copy is p2.copy  # O1: one copy of the storage
        assert engine.live_bytes == footprint(base.untyped_storage().nbytes())  # H2: the pool's block
        u1, u2 = p1.unpack(), p2.unpack()
        assert torch.equal(u1, v1) and u1.stride() == v1.stride()
        assert torch.equal(u2, v2) and u2.stride() == v2.stride() and u2.storage_offset() == v2.storage_offset()
        base.add_(1)  # a new version: a new copy
        p3 = engine.pack(base, "c")
        assert p3.copy is not p1.copy


def test_the_stand_in_catches_a_missing_wait_and_a_source_freed_too_early(monkeypatch):
    """The checks below have teeth: without the consumer's wait the gradients are NaN;
    without record_stream the copy out finds its source gone."""
    ws = mlp_params("cpu")
    x = torch.randn(8, 16, requires_grad=True)
    ref = grads(x, ws)
    with host_copy_stand_in() as b:
        engine = Offloader(host_limit=None)
        real = HostCopyStandIn.wait_event

        def wait_in_side_context(self, stream, event):
            # the known bug: the wait issued while the side stream is current
            return real(self, event.stream, event)

        with monkeypatch.context() as m:
            m.setattr(HostCopyStandIn, "wait_event", wait_in_side_context)
            engine.new_step()
            got = grads(x, ws, offload_all(engine))
        assert not same(got, ref) and any(torch.isnan(g).any() for g in got)
        b.drain()
        with monkeypatch.context() as m:
            m.setattr(HostCopyStandIn, "record_stream", lambda self, t, s: None)
            engine = Offloader(host_limit=None)
            engine.new_step()
            with pytest.raises(RuntimeError, match="freed before the copy ran") as info:
                grads(x, ws, offload_all(engine))
            for ref in b.streams:  # the other copies lost their sources too: drop them
                if ref() is not None:
                    ref().queue.clear()
            del info


def test_copies_back_follow_the_last_backward_order_and_run_ahead_of_need():
    ws = mlp_params("cpu")
    x = torch.randn(8, 16, requires_grad=True)
    with host_copy_stand_in():
        engine = Offloader(host_limit=None)
        engine.new_step()
        grads(x, ws, offload_all(engine))
        first = list(dict.fromkeys(engine.used))
        issued = []
        real = engine.copy_back

        def spy(hc):
            issued.append((hc.key, tuple(engine.used)))
            real(hc)

        engine.copy_back = spy
        engine.new_step()
        grads(x, ws, offload_all(engine))
        order = [k for k, _ in issued]
        assert order == [k for k in first if k in order]  # O4: the recorded backward order
        # ahead of need: most copies back were issued before their own unpack
        ahead = sum(1 for key, used in issued if key not in used)
        assert ahead >= len(issued) - 1
        # within the window: bytes fetched and not yet used never exceed it
        assert engine.in_flight == 0


@pytest.mark.parametrize("device", DEVICES)
def test_an_exception_mid_backward_leaves_nothing_in_flight_or_held(device):
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h):
            return h.clone()

        @staticmethod
        def backward(ctx, g):
            raise ValueError("boom")

    ws = mlp_params(device)
    x = torch.randn(8, 16, device=device, requires_grad=True)
    with backend(device) as b:
        engine = Offloader(host_limit=None)
        engine.new_step()
        with offload_all(engine):
            h = Boom.apply(x @ ws[0]).tanh()
            loss = mlp(h, ws[1:])
        assert engine.live_bytes > 0
        with pytest.raises(ValueError, match="boom"):
            loss.backward()
        del loss, h
        assert engine.live_bytes == 0 and engine.in_flight == 0
        if b is not None:
            assert b.pending() == 0  # no copy in flight
        engine.release_host_memory()
        assert engine.reserved_bytes == 0


@pytest.mark.parametrize("device", DEVICES)
def test_an_exception_mid_forward_leaves_nothing_held(device):
    ws = mlp_params(device)
    x = torch.randn(8, 16, device=device, requires_grad=True)
    with backend(device) as b:
        engine = Offloader(host_limit=None)
        engine.new_step()
        with pytest.raises(RuntimeError):
            with offload_all(engine):
                h = (x @ ws[0]).tanh()
                h @ torch.randn(3, 3, device=device)  # shapes do not match
        del h
        assert engine.live_bytes == 0
        if b is not None:
            assert b.pending() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_two_models_with_their_own_engines_interleaved(device):
    a, bw = mlp_params(device), [w.detach().clone().mul(0.5).requires_grad_() for w in mlp_params(device)]
    x = torch.randn(8, 16, device=device, requires_grad=True)
    ref_a, ref_b = grads(x, a), grads(x, bw)
    with backend(device):
        ea, eb = Offloader(None), Offloader(None)
        for _ in range(2):
            ea.new_step()
            eb.new_step()
            with offload_all(ea):
                la = mlp(x, a)
            with offload_all(eb):
                lb = mlp(x, bw)
            for t in (x, *a, *bw):
                t.grad = None
            lb.backward()
            got_b = [t.grad.clone() for t in (x, *bw)]
            x.grad = None
            la.backward()
            got_a = [t.grad.clone() for t in (x, *a)]
            assert same(got_a, ref_a) and same(got_b, ref_b)


@pytest.mark.parametrize("device", DEVICES)
def test_a_write_after_the_save_raises_pytorchs_inplace_error(device):
    with backend(device):
        engine = Offloader(None)
        w = torch.randn(4, 4, device=device, requires_grad=True)
        with offload_all(engine):
            h = w.exp()
            y = (h * h).sum()
        with torch.no_grad():
            h.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_a_data_swap_of_a_saved_input_is_seen_as_autograd_sees_it(device):
    def run(hooks):
        a = torch.randn(4, 4, device=device, generator=None, requires_grad=True)
        x = torch.full((4, 4), 2.0, device=device)
        with hooks:
            y = (a * x).sum()  # mul saves x itself (an input of its node)
        x.data = torch.full((4, 4), 3.0, device=device)
        y.backward()
        return a.grad

    plain = run(contextlib.nullcontext())
    assert torch.equal(plain, torch.full((4, 4), 3.0, device=device))  # what autograd does
    with backend(device):
        engine = Offloader(None)
        assert torch.equal(run(offload_all(engine)), plain)


@pytest.mark.parametrize("device", DEVICES)
def test_the_host_pool_is_bounded_and_what_does_not_fit_stays(device):
    ws = mlp_params(device)
    x = torch.randn(8, 16, device=device, requires_grad=True)
    ref = grads(x, ws)
    with backend(device):
        engine = Offloader(host_limit=4096)
        log = []
        engine.new_step()
        assert same(grads(x, ws, offload_all(engine, log)), ref)
        kept = [p for _, _, p in log]
        assert any(kept) and not all(kept)
        assert engine.reserved_bytes <= 4096
        # the second step allocates nothing new: the slab is carved again
        engine.new_step()
        grads(x, ws, offload_all(engine))
        assert engine.reserved_bytes <= 4096 and len(engine.pools) == 1
        assert len(next(iter(engine.pools.values())).slabs) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_an_input_offloaded_in_place_comes_back_for_its_reader(device):
    with backend(device):
        engine = Offloader(None)
        src = torch.randn(5, 7, device=device)
        expected = src.clone()
        alias = src.detach()
        # the source itself still holds the storage: not ours alone, not offloaded
        assert not evict(engine, [alias], "in")
        ref = weakref.ref(src)
        del src
        assert ref() is None
        assert evict(engine, [alias], "in")
        assert alias.untyped_storage().nbytes() == 0
        engine.start_backward()  # prefetched into a buffer of its own
        assert restore(engine, alias)
        assert torch.equal(alias, expected)
        assert not restore(engine, alias)  # once
        del alias
        gc.collect()
        assert engine.live_bytes == 0


def test_a_stand_in_side_stream_runs_nothing_until_waited_on():
    b = HostCopyStandIn()
    side = b.new_stream(torch.device("cpu"))
    dst = b.device_empty(4, torch.device("cpu"))
    src = torch.arange(4, dtype=torch.uint8)
    with b.use_stream(side):
        b.copy(dst, src)
        ev = b.record_event(side)
    b.record_stream(src, side)
    assert dst.tolist() == [255] * 4 and not b.done(ev)
    b.synchronize(ev)
    assert dst.tolist() == [0, 1, 2, 3] and b.done(ev)
    assert streams.backend_for(torch.ones(1)) is None  # no stand-in active: CPU stays


def test_the_stream_current_at_each_pack_and_unpack_is_the_one_used():
    """O2, O3: the producer's event is recorded on the stream current when the tensor is
    packed, and the consumer's wait is issued on the stream current at unpack -- not a
    stream cached from an earlier call."""
    from gradient_scope._budget.streams import _FakeStream

    ws = mlp_params("cpu")
    x = torch.randn(8, 16, requires_grad=True)
    ref = grads(x, ws)
    with host_copy_stand_in() as b:
        engine = Offloader(None)
        engine.new_step()
        grads(x, ws, offload_all(engine))  # a first step on the default stream
        other = _FakeStream(deferred=False)
        recorded, waited = [], []
        real_record, real_wait = HostCopyStandIn.record_event, HostCopyStandIn.wait_event

        def record(self, stream):
            recorded.append(stream)
            return real_record(self, stream)

        def wait(self, stream, event):
            waited.append(stream)
            return real_wait(self, stream, event)

        b.record_event = record.__get__(b)
        b.wait_event = wait.__get__(b)
        engine.new_step()
        with b.use_stream(other):
            assert same(grads(x, ws, offload_all(engine)), ref)
        side = {s for s in recorded if s is not other and s.deferred}
        assert other in recorded and side  # producer events on `other`, copy events on the side streams
        assert b.compute not in recorded and b.compute not in waited
        assert other in waited  # the consumer's waits on the stream current at unpack
