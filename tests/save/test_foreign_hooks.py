"""Foreign saved_tensors_hooks (a recording pair, save_on_cpu) entered around, inside and
after a scope and exited in every order relative to the scope's tensors dying
(``docs/compatibility.md``).

Each scenario is a script of events run by a small driver:

  S+ / S-       enter / exit the scope (a no-op in the plain run)
  H+ / H-       enter / exit a foreign hook context (H1, H2 when there are two)
  in1, in2      ops inside the block;  post1, post2  ops after it, reading block tensors
  die           the block's tensors are dropped (``del``)
  post3         an op on outside tensors only, after everything

Every op saves tensors of a distinct shape, so a recording pack hook tells block-created
tensors (shapes (2, 3) and (2, 5)) from the rest. The expected contents of each hook come
from PyTorch's rule as ``docs/compatibility.md`` states it: the innermost open context applies; the scope's
interception counts as entered at ``S+`` and stays until ``die``; while it is innermost,
block tensors become handles and everything else goes to the innermost open foreign
hook. No hook receives anything after its own exit.

Exits are performed two ways: ``call`` looks ``__exit__`` up when the exit happens (an
explicit ``h.__exit__()``); ``with`` binds ``type(h).__exit__`` when the context is
entered, which is exactly what a ``with`` statement does. Gradients equal the plain run.
"""

import collections

import pytest
import torch
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

from support import assert_stacks_clean, stat

B_SHAPES = {(2, 3), (2, 5)}  # shapes of block-created tensors

# what each op saves: (shape, created in the block)
SAVES = {
    "in1": [((2, 3), True), ((2, 3), True), ((3, 5), False)],  # x = a.exp(); m = x @ w
    "in2": [((2, 5), True)],  # g = m.tanh()
    "post1": [((2, 5), True), ((5, 7), False)],  # y = g @ c
    "post2": [((2, 7), False), ((2, 7), False)],  # z = y * d
    "post3": [((4, 4), False)],  # r = e.sin()
}


class Recorder:
    """A plain saved_tensors_hooks pair (no subclass override of __exit__) recording the
    shape of everything it packs, and anything packed after its exit."""

    def __init__(self, name):
        self.name = name
        self.packed = []
        self.after_exit = []
        self.unpacked = 0
        self.open = False
        self.ctx = saved_tensors_hooks(self._pack, self._unpack)
        self._bound_exit = None

    def _pack(self, t):
        shape = tuple(t.shape)
        (self.packed if self.open else self.after_exit).append(shape)
        return t.detach()

    def _unpack(self, t):
        self.unpacked += 1
        return t

    def enter(self, style):
        if style == "with":  # what the with statement does
            self._bound_exit = type(self.ctx).__exit__
        type(self.ctx).__enter__(self.ctx)
        self.open = True

    def exit(self, style):
        self.open = False
        if style == "with":
            self._bound_exit(self.ctx, None, None, None)
        else:
            self.ctx.__exit__(None, None, None)


class SaveOnCpu:
    def __init__(self, name):
        self.name = name
        self.ctx = save_on_cpu(pin_memory=False)

    def enter(self, style):
        self._bound_exit = type(self.ctx).__exit__
        type(self.ctx).__enter__(self.ctx)

    def exit(self, style):
        if style == "with":
            self._bound_exit(self.ctx, None, None, None)
        else:
            self.ctx.__exit__(None, None, None)


def run_script(script, real, hook_cls, style, device):
    """Run the script; return (results dict, hooks, scope or None)."""
    torch.manual_seed(0)
    a = torch.randn(2, 3, requires_grad=True, device=device)
    w = torch.randn(3, 5, requires_grad=True, device=device)
    c = torch.randn(5, 7, requires_grad=True, device=device)
    d = torch.randn(2, 7, requires_grad=True, device=device)
    e = torch.randn(4, 4, requires_grad=True, device=device)
    hooks = {}
    scope = None
    env = {}
    from gradient_scope import recompute_scope

    for ev in script.split():
        name, sign = ev[:-1], ev[-1]
        if ev in ("S+", "S-"):
            if real:
                if ev == "S+":
                    scope = recompute_scope()
                    scope.__enter__()
                else:
                    scope.__exit__(None, None, None)
        elif sign in "+-" and name.startswith("H"):
            if sign == "+":
                hooks[name] = hook_cls(name)
                hooks[name].enter(style)
            else:
                hooks[name].exit(style)
        elif ev == "in1":
            env["x"] = a.exp()
            env["m"] = env["x"] @ w
        elif ev == "in2":
            env["g"] = env["m"].tanh()
        elif ev == "post1":
            env["y"] = env["g"] @ c
        elif ev == "post2":
            env["z"] = env["y"] * d
        elif ev == "die":
            del env["x"], env["m"], env["g"]
        elif ev == "post3":
            env["r"] = e.sin()
        else:
            raise AssertionError(ev)
    loss = env["z"].sum() + env["r"].sum()
    del env
    loss.backward()
    out = dict(loss=loss.detach(), a=a.grad, w=w.grad, c=c.grad, d=d.grad, e=e.grad)
    return out, hooks, scope


def expected_packs(script, real):
    """{hook name: Counter of shapes it receives}, and the number of handles."""
    order = []  # open contexts in entry order ("S" = the scope's interception)
    got = collections.defaultdict(collections.Counter)
    handles = 0
    for ev in script.split():
        name, sign = ev[:-1], ev[-1]
        if ev == "S+":
            if real:
                order.append("S")
        elif ev == "S-":
            pass  # the interception outlives the block while its tensors live
        elif ev == "die":
            if "S" in order:
                order.remove("S")
        elif sign in "+-" and name.startswith("H"):
            order.append(name) if sign == "+" else order.remove(name)
        else:
            for shape, block in SAVES[ev]:
                if not order:
                    continue
                if order[-1] == "S":
                    if block:
                        handles += 1
                        continue
                    foreign = [h for h in order if h != "S"]
                    if foreign:
                        got[foreign[-1]][shape] += 1
                else:
                    got[order[-1]][shape] += 1
    return got, handles


SCRIPTS = {
    # entered before the block
    "around_exit_after_die": "H+ S+ in1 in2 S- post1 post2 die H- post3",
    "around_exit_before_die": "H+ S+ in1 in2 S- post1 H- post2 die post3",
    "before_exit_inside_block": "H+ S+ in1 H- in2 S- post1 post2 die post3",
    "before_and_closed_before": "H+ H- S+ in1 in2 S- post1 post2 die post3",
    # entered inside the block
    "inside_nested": "S+ H+ in1 in2 H- S- post1 post2 die post3",
    "inside_exit_after_block": "S+ H+ in1 in2 S- post1 H- post2 die post3",
    "inside_exit_after_die": "S+ H+ in1 in2 S- post1 post2 die H- post3",
    "inside_between_ops": "S+ in1 H+ in2 H- S- post1 post2 die post3",
    # entered after the block
    "after_exit_before_die": "S+ in1 in2 S- H+ post1 H- post2 die post3",
    "after_exit_after_die": "S+ in1 in2 S- H+ post1 post2 die H- post3",
    "after_die": "S+ in1 in2 S- post1 post2 die H+ post3 H-",
    # two foreign contexts (nested in each other, as plain PyTorch requires: its
    # __exit__ pops whatever is on top), crossed with the scope
    "two_h1_before_h2_inside": "H1+ S+ H2+ in1 H2- in2 S- post1 H1- post2 die post3",
    "two_h1_before_h2_after": "H1+ S+ in1 in2 S- H2+ post1 H2- post2 H1- die post3",
    "two_both_before": "H1+ H2+ S+ in1 H2- in2 S- post1 post2 H1- die post3",
    "two_inside_and_after": "S+ H1+ in1 in2 S- H2+ post1 H2- post2 die H1- post3",
}

STYLES = ["call", "with"]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_recording_hook_receives_per_contract(name, style, device):
    script = SCRIPTS[name]
    script_h = script.replace("H+", "H0+").replace("H-", "H0-")
    plain, plain_hooks, _ = run_script(script_h, False, Recorder, style, device)
    want_plain, _ = expected_packs(script_h, False)
    for hname, h in plain_hooks.items():  # sanity of the model on plain PyTorch
        assert collections.Counter(h.packed) == want_plain[hname], (hname, h.packed)
    del plain_hooks

    actual, hooks, scope = run_script(script_h, True, Recorder, style, device)
    want, handles = expected_packs(script_h, True)
    problems = []
    for hname, h in hooks.items():
        if h.after_exit:
            problems.append(f"{hname} received {h.after_exit} after its exit")
        if collections.Counter(h.packed) != want[hname]:
            problems.append(f"{hname} received {sorted(h.packed)}, expected {sorted(want[hname].elements())}")
        if h.unpacked != len(h.packed) + len(h.after_exit):
            problems.append(f"{hname} unpacked {h.unpacked} of {len(h.packed)} packed")
    if stat(scope, "tensors_packed") != handles:
        problems.append(f"scope packed {stat(scope, 'tensors_packed')} handles, expected {handles}")
    for k in plain:
        if not torch.equal(actual[k], plain[k]):
            problems.append(f"{k} differs from the plain program")
    del hooks, scope, actual, plain
    assert not problems, "\n".join(problems)
    assert_stacks_clean()


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_save_on_cpu_gradients(name, style, device):
    script = SCRIPTS[name].replace("H+", "H0+").replace("H-", "H0-")
    plain, _, _ = run_script(script, False, SaveOnCpu, style, device)
    actual, hooks, scope = run_script(script, True, SaveOnCpu, style, device)
    del hooks, scope
    for k in plain:
        assert torch.equal(actual[k], plain[k]), k
    assert_stacks_clean()


# ----------------------------------------------------------------------------------------
# the same, written as literal with statements


def test_literal_with_around_scope_tensors_outlive_hook(device):
    """with save_on_cpu(): with scope: ...  -- block tensors still alive (and saved again)
    after save_on_cpu's with statement ends."""
    from gradient_scope import recompute_scope

    got = []

    def pack(t):
        got.append(tuple(t.shape))
        return t.detach()

    a = torch.randn(2, 3, requires_grad=True, device=device)
    w = torch.randn(3, 5, requires_grad=True, device=device)
    with saved_tensors_hooks(pack, lambda t: t):
        with recompute_scope():
            x = a.exp()
            m = x @ w
        n_inside = len(got)
    # the hook context has exited: nothing may reach it any more
    y = m.sin() * a.sum()
    assert len(got) == n_inside, f"hook received {got[n_inside:]} after its exit"
    del x, m
    y.sum().backward()
    assert_stacks_clean()


def test_literal_with_hook_inside_scope(device):
    from gradient_scope import recompute_scope

    got = []

    def pack(t):
        got.append(tuple(t.shape))
        return t.detach()

    a = torch.randn(2, 3, requires_grad=True, device=device)
    w = torch.randn(3, 5, requires_grad=True, device=device)
    with recompute_scope() as s:
        with saved_tensors_hooks(pack, lambda t: t):
            x = a.exp()  # saves x: the hook is innermost, it gets x
            m = x @ w  # x, w
    assert sorted(got) == sorted([(2, 3), (2, 3), (3, 5)])
    y = m.sin()  # saves m after the hook's exit: a handle
    assert len(got) == 3
    assert stat(s, "tensors_packed") == 1
    del x, m
    y.sum().backward()
    del y
    assert_stacks_clean()


def test_hook_between_nested_scopes(device):
    """with S1: ... with H: ... with S2: ...  H (entered inside S1, still open) gets S1's
    block tensors; S2 was entered inside H, so S2's block tensors stay recomputable."""
    from gradient_scope import recompute_scope

    got = []

    def pack(t):
        got.append(tuple(t.shape))
        return t.detach()

    a = torch.randn(2, 3, requires_grad=True, device=device)
    b = torch.randn(1, 3, requires_grad=True, device=device)
    with recompute_scope() as s1:
        p = a.exp()  # S1 tensor, saved while S1's interception is innermost: a handle
        with saved_tensors_hooks(pack, lambda t: t):
            q = p.sin()  # saves p: H is innermost
            with recompute_scope() as s2:
                x = b.exp()  # saves x (an S2 tensor): a handle
                y = x * p  # saves x (S2: a handle) and p (S1's: H gets it)
    assert sorted(got) == [(2, 3), (2, 3)], got
    assert stat(s2, "tensors_packed") == 2
    loss = (q + y).sum()
    del p, q, x, y
    loss.backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    p = a.exp()
    y = b.exp() * p
    (p.sin() + y).sum().backward()
    assert torch.equal(ga, a.grad) and torch.equal(gb, b.grad)
    del s1, s2, p, y, loss
    assert_stacks_clean()


def test_what_a_pair_below_the_scope_computes_is_not_recorded():
    """A pair entered before a block gets the tensors the block does not intercept
    (S2); what its pack computes (here a copy, as save_on_cpu makes) is not the
    block's computation: not recorded, and not a block tensor kept alive."""
    from gradient_scope import recompute_scope

    def run(outer):
        torch.manual_seed(0)
        a, b = (torch.randn(4, 4, requires_grad=True) for _ in range(2))
        with outer:
            s = recompute_scope()
            with s:
                h = (a @ b).tanh()  # mm saves a and b: handed to the outer pair
            y = (h * h).sum()
        y.backward()
        return s.stats.ops_recorded, a.grad

    import contextlib

    ops, grad = run(contextlib.nullcontext())
    copying = saved_tensors_hooks(lambda t: t.clone(), lambda t: t)
    ops_hooked, grad_hooked = run(copying)
    assert ops_hooked == ops == 2
    assert torch.equal(grad_hooked, grad)
    assert_stacks_clean()
