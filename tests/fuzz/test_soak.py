"""Soak: 500 training steps of a small model with scopes.  No growth in the number of live
tensors (``gc.get_objects()`` filtered to tensors, sampled at a few points), in process
RSS beyond noise (``/proc/self/statm``), or in the saved-tensor hook stack (checked after
every step).  Runs in a few seconds."""

import gc
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradient_scope import recompute, recompute_scope

from support import assert_stacks_clean, dispatch_depth, top_hooks

STEPS = 500
SAMPLES = (100, 200, 300, 400, 500)
RSS_NOISE = 8 * 2**20  # bytes of RSS growth tolerated between step 100 and step 500


def live_tensors():
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def collect_all():
    """Collect until nothing more is found: garbage left by earlier tests (dynamo's cache
    entries and fakes among it) can take more than one pass, as finalizers run in one
    pass release objects that only the next pass frees."""
    while gc.collect():
        pass


def rss_bytes():
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        with recompute_scope():
            h = F.gelu(self.fc1(self.ln(x)))
            with recompute_scope(save=[torch.ops.aten.mm, torch.ops.aten.addmm]):
                h = F.dropout(h, 0.1, self.training) * torch.sigmoid(h)
        return x + self.fc2(h)  # h, a block tensor, saved after the block


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block()])
        self.head = nn.Linear(16, 4)

    @recompute
    def _tail(self, x):
        return torch.tanh(x) * x

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self._tail(x))


def test_soak_500_steps():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    hooks0 = top_hooks()
    modes0 = dispatch_depth()
    samples = {}
    bad_steps = []

    def step():
        x = torch.randn(8, 16)
        t = torch.randn(8, 4)
        opt.zero_grad()
        loss = F.mse_loss(model(x), t)
        loss.backward()
        opt.step()
        return loss.item()

    for i in range(1, STEPS + 1):
        step()
        if top_hooks() != hooks0 or dispatch_depth() != modes0:
            bad_steps.append(i)
        if i in SAMPLES:
            collect_all()
            samples[i] = (live_tensors(), rss_bytes())

    assert not bad_steps, f"hook/mode stack not back to what it was after steps {bad_steps[:10]}"
    counts = {i: c for i, (c, _) in samples.items()}
    first = SAMPLES[0]
    assert all(c == counts[first] for c in counts.values()), f"live tensors grew: {counts}"
    rss = {i: r for i, (_, r) in samples.items()}
    growth = rss[SAMPLES[-1]] - rss[first]
    assert growth < RSS_NOISE, f"RSS grew by {growth / 2**20:.1f} MiB: { {i: r >> 20 for i, r in rss.items()} }"
    del model, opt
    assert_stacks_clean()
