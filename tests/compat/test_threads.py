"""Threads (``docs/compatibility.md``): backward may run in another thread than forward;
scopes in several threads at once are independent.  Ground truth: the plain program,
``torch.equal``.
"""

import threading

import pytest
import torch
import torch.nn.functional as F

from gradient_scope import recompute_scope

from support import PlainScopes, Scopes, assert_stacks_clean, grads, top_hooks
from support.interop import run_both_clean

TIMEOUT = 60


def in_thread(fn, *args):
    """Run fn(*args) in a new thread; return its result, re-raise its exception."""
    box = {}

    def target():
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001
            box["error"] = f"{type(e).__name__}: {e}"
        box["hooks_at_end"] = top_hooks()

    t = threading.Thread(target=target)
    t.start()
    t.join(TIMEOUT)
    assert not t.is_alive(), "thread did not finish"
    if "error" in box:
        raise AssertionError(f"in thread: {box['error']}")
    return box


# ----------------------------------------------------------------------------------------
# backward in another thread


def test_backward_in_other_thread_tensors_dead(device):
    def program(scope):
        a, b, c = (torch.randn(5, 6, requires_grad=True, device=device) for _ in range(3))
        with scope():
            h = (a * b).exp()
            d = torch.dropout(h, 0.3, True).tanh()
        y = (d * c).sum() + (h * h).sum()
        del h, d
        box = in_thread(lambda: y.backward())
        assert box["hooks_at_end"] is None
        return grads(dict(a=a, b=b, c=c))

    run_both_clean(program)
    assert_stacks_clean()


def test_backward_in_other_thread_tensors_alive(device):
    """Block tensors still alive in the forward thread while backward runs elsewhere."""

    def program(scope):
        a, b = (torch.randn(4, 4, requires_grad=True, device=device) for _ in range(2))
        with scope():
            h = (a @ b).sigmoid()
        y = (h * h.t()).sum()
        in_thread(lambda: y.backward())
        out = dict(h=h.detach().clone(), **grads(dict(a=a, b=b)))
        del h
        return out

    run_both_clean(program)
    assert_stacks_clean()


def test_last_block_tensor_dies_in_other_thread(device):
    """The worker thread holds the only references (graph and block tensors), runs
    backward and drops them: the main thread's pair leaves at once (its next bytecode
    boundary, I8), without gc; PyTorch's own in-place check and later scopes work."""
    hooks0 = top_hooks()
    a, b = (torch.randn(4, 4, requires_grad=True, device=device) for _ in range(2))
    with recompute_scope():
        h = (a @ b).exp()
    holder = [h, (h * b).sum()]
    del h
    assert top_hooks() != hooks0

    def work():
        holder[1].backward()
        holder.clear()

    in_thread(work)
    assert top_hooks() == hooks0, f"forward thread left with hooks {top_hooks()}"
    assert_stacks_clean()
    w = torch.randn(3, requires_grad=True, device=device)
    p = w * 2
    q = p.sin()
    p.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        q.sum().backward()
    ga = a.grad.clone()
    a.grad = b.grad = None
    ((a @ b).exp() * b).sum().backward()
    assert torch.equal(ga, a.grad)
    assert top_hooks() == hooks0
    assert_stacks_clean()


def test_many_backwards_in_threads_with_retain_graph(device):
    def program(scope):
        a, b = (torch.randn(6, 3, requires_grad=True, device=device) for _ in range(2))
        with scope():
            h = (a + b).sin() * a
        y = (h.exp() * b).sum()
        del h
        outs = []
        for _ in range(3):
            in_thread(lambda: y.backward(retain_graph=True))
            outs.append(a.grad.clone())
        return dict(outs=outs, **grads(dict(a=a, b=b)))

    run_both_clean(program)
    assert_stacks_clean()


# ----------------------------------------------------------------------------------------
# concurrent training in two threads


class Net(torch.nn.Module):
    def __init__(self, gen):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(8, 16, generator=gen, device=gen.device) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(16, 16, generator=gen, device=gen.device) * 0.3)
        self.w3 = torch.nn.Parameter(torch.randn(16, 2, generator=gen, device=gen.device) * 0.3)

    def forward(self, x, scope, gen):
        h = x @ self.w1
        with scope():
            a = F.gelu(h)
            mask = torch.bernoulli(torch.full_like(a, 0.8), generator=gen)
            a = a * mask / 0.8
            with scope():
                b = torch.tanh(a @ self.w2)
        c = b * a
        return c @ self.w3


def train(seed, scope, device, steps=15):
    gen = torch.Generator(device=device).manual_seed(seed)
    net = Net(gen)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        x = torch.randn(6, 8, generator=gen, device=device)
        t = torch.randn(6, 2, generator=gen, device=device)
        opt.zero_grad()
        loss = (net(x, scope, gen) - t).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in net.parameters()]


def test_two_threads_train_concurrently(device):
    seeds = [1, 2]
    sequential = [train(s, Scopes(), device) for s in seeds]
    plain = [train(s, PlainScopes(), device) for s in seeds]

    results = {}
    errors = []
    barrier = threading.Barrier(len(seeds))

    def worker(s):
        try:
            barrier.wait(TIMEOUT)
            results[s] = train(s, Scopes(), device)
            results[(s, "hooks")] = top_hooks()
        except BaseException as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "threads did not finish"
    assert not errors, errors
    for i, s in enumerate(seeds):
        assert results[(s, "hooks")] is None, "a worker thread was left with hooks"
        conc_losses, conc_params = results[s]
        seq_losses, seq_params = sequential[i]
        plain_losses, plain_params = plain[i]
        for x, y, z in zip(conc_losses + conc_params, seq_losses + seq_params, plain_losses + plain_params):
            assert torch.equal(x, y), f"seed {s}: concurrent != sequential"
            assert torch.equal(y, z), f"seed {s}: scoped != plain"
    del results, sequential, plain
    assert_stacks_clean()


def test_thread_forward_while_other_thread_backward(device):
    """One thread runs forwards with open scopes while another thread runs backward of
    graphs the first produced (a pipeline), results equal to the plain program."""
    import queue

    def program(scope):
        gen = torch.Generator(device=device).manual_seed(3)
        w = torch.randn(5, 5, generator=gen, requires_grad=True, device=device)
        q = queue.Queue()
        done = []

        def consumer():
            while True:
                item = q.get()
                if item is None:
                    return
                item.backward()
                done.append(1)

        t = threading.Thread(target=consumer)
        t.start()
        for _ in range(6):
            x = torch.randn(3, 5, generator=gen, device=device)
            with scope():
                h = (x @ w).tanh()
                k = h * h.exp()
            q.put((k @ w).sum())
            del h, k
        q.put(None)
        t.join(TIMEOUT)
        assert not t.is_alive() and len(done) == 6
        return grads(dict(w=w))

    run_both_clean(program)
    assert_stacks_clean()


def test_main_thread_pair_leaves_when_its_last_tensor_dies_in_another_thread(device):
    """The main thread's last block tensor dies in a worker: the pair is gone before
    the main thread's next line runs, torch.func runs there, nothing waits for gc."""
    import gc
    import weakref

    hooks0 = top_hooks()
    was = gc.isenabled()
    gc.disable()
    try:
        a, b = (torch.randn(4, 4, requires_grad=True, device=device) for _ in range(2))
        with recompute_scope():
            h = (a @ b).exp()
        ref = weakref.ref(h)
        holder = [h, (h * b).sum()]
        del h

        def work():
            holder[1].backward()
            holder.clear()

        in_thread(work)
        assert ref() is None and top_hooks() == hooks0
        assert_stacks_clean()
        g = torch.func.grad(lambda t: t.sin().sum())(torch.ones(3, device=device))
        assert torch.equal(g, torch.ones(3, device=device).cos())
    finally:
        if was:
            gc.enable()


def test_worker_forward_thread_pair_leaves_at_its_next_safe_point(device):
    """A forward thread other than the main thread cannot be interrupted: its pair
    leaves at that thread's next safe point -- here a torch.func call, which then runs
    (I6, I8) -- and meanwhile it is inert."""
    ready, dropped = threading.Event(), threading.Event()
    box = {}

    def forward_thread():
        a, b = (torch.randn(4, 4, requires_grad=True, device=device) for _ in range(2))
        with recompute_scope():
            h = (a @ b).exp()
        box["holder"] = [h, (h * b).sum()]
        del h
        ready.set()
        dropped.wait(TIMEOUT)
        box["before"] = top_hooks() is not None
        box["grad"] = torch.func.grad(lambda t: t.sin().sum())(torch.ones(3, device=device))
        box["after"] = top_hooks()

    t = threading.Thread(target=forward_thread)
    t.start()
    assert ready.wait(TIMEOUT)
    box["holder"][1].backward()
    box.pop("holder")
    dropped.set()
    t.join(TIMEOUT)
    assert not t.is_alive()
    assert box["before"] and box["after"] is None
    assert torch.equal(box["grad"], torch.ones(3, device=device).cos())
    assert_stacks_clean()
