"""What a budget's plan says, for people: the stored ops, the curve, the units."""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["StoredOp", "CurvePoint", "BudgetCurve", "fmt_bytes", "fmt_seconds", "stored_table"]


def fmt_bytes(n: float) -> str:
    """``n`` bytes in binary units (``"1.50 MiB"``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float) -> str:
    """``s`` seconds in a readable unit (``"1.25 ms"``)."""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= size:
            return f"{s / size:.3g} {unit}"
    return "0 s" if s == 0 else f"{s * 1e9:.3g} ns"


class StoredOp(NamedTuple):
    """One saved output in a budget's plan: the block (``file.py:line#occurrence``, or
    the module path), the op, which of its outputs, the bytes of its storage (0: in
    memory anyway), and what the plan does with it: ``"kept"`` on the device,
    ``"offloaded"`` to host memory, or ``"recomputed"``. Outside tensors a block keeps
    for replay and tensors the code outside the scopes saves show with their storage
    (op ``"input"``, or the autograd node that saved them).

    ``module`` and ``line``: where autograd saved it, as the saved-tensor report names a
    save -- the path of the module running then (from the model's root) and the source
    line (``modeling_llama.py:57``), from the step the plan measured ("" where unknown).
    ``why``: the plan's reason, in words (the recompute time it spares per byte, the
    copy it moves to host memory)."""

    block: str
    op: str
    output: int
    nbytes: int
    how: str = "kept"
    module: str = ""
    line: str = ""
    why: str = ""


_HOW = ("kept", "offloaded", "recomputed")
_BY = {
    "module": lambda r: r.module or r.block,
    "block": lambda r: r.block,
    "op": lambda r: f"{r.module or r.block}  {r.op}  {r.line}".rstrip(),
}


def stored_table(rows: list[StoredOp], by: str = "module") -> str:
    """``rows`` (a plan's stored ops) as a table grouped ``by`` ``"module"`` (the module
    path each was saved in: the report's ``by="module"``), ``"block"`` or ``"op"`` (one row
    per module, op and source line): the bytes kept, offloaded and recomputed, largest
    groups first; ``"op"`` adds the plan's reason of the group's largest row."""
    if by not in _BY:
        raise ValueError(f"stored_ops table: by must be one of {', '.join(map(repr, _BY))}, got {by!r}")
    groups: dict[str, dict[str, int]] = {}
    why: dict[str, tuple[int, str]] = {}
    for r in rows:
        key = _BY[by](r)
        g = groups.setdefault(key, dict.fromkeys(_HOW, 0))
        g[r.how] = g.get(r.how, 0) + r.nbytes
        if r.why and r.nbytes >= why.get(key, (-1, ""))[0]:
            why[key] = (r.nbytes, r.why)
    order = sorted(groups, key=lambda k: -sum(groups[k].values()))
    width = max([len(by), *map(len, order)])
    head = f"{by:<{width}}  {'kept':>10}  {'offloaded':>10}  {'recomputed':>10}"
    lines = [head, "-" * len(head)]
    for key in order:
        g = groups[key]
        line = f"{key:<{width}}  " + "  ".join(f"{fmt_bytes(g[h]):>10}" for h in _HOW)
        lines.append(line + (f"  {why[key][1]}" if by == "op" and key in why else ""))
    return "\n".join(lines)


class CurvePoint(NamedTuple):
    """The plan at one budget: device bytes after forward, host bytes offloaded,
    predicted seconds of recompute, of copies compute does not hide, and of a step."""

    budget: int
    device: int
    host: int
    recompute: float
    transfer: float
    step: float


class BudgetCurve:
    """The predicted trade-off for every budget, from the last measured step.

    ``points``: one :class:`CurvePoint` per budget at which the plan changes, budgets
    ascending; a budget between two points gets the plan of the lower one. ``rows``:
    ``(budget bytes, predicted step seconds)`` pairs. ``str(curve)`` is a table with its
    units; :meth:`plot` writes a PNG (needs matplotlib).
    """

    def __init__(self, points: list[CurvePoint], budget: int, floor: int) -> None:
        self.points = points
        self.budget = budget
        self.floor = floor

    @property
    def rows(self) -> list[tuple[int, float]]:
        return [(p.budget, p.step) for p in self.points]

    def at(self, nbytes: int) -> CurvePoint | None:
        """The plan at a budget of ``nbytes`` (None below the lowest point)."""
        best = None
        for p in self.points:
            if p.budget <= nbytes:
                best = p
        return best

    def recompute_at(self, nbytes: int) -> float | None:
        """Predicted recompute seconds at a budget of ``nbytes`` (None below the floor)."""
        p = self.at(nbytes)
        return None if p is None else p.recompute

    def __str__(self) -> str:
        return self.table()

    def table(self, rows: int = 16) -> str:
        """The curve as a table of at most about ``rows`` rows (the first, the last, this
        budget's, and evenly between)."""
        here = self.at(self.budget)
        head = ("budget", "on device", "offloaded", "recompute", "copy wait", "step")
        lines = ["  ".join(f"{h:>11}" for h in head), "-" * 76]
        step = max(1, -(-len(self.points) // max(rows, 2)))
        shown = [p for i, p in enumerate(self.points) if i % step == 0 or p is here or i == len(self.points) - 1]
        for p in shown:
            cells = (
                fmt_bytes(p.budget),
                fmt_bytes(p.device),
                fmt_bytes(p.host),
                fmt_seconds(p.recompute),
                fmt_seconds(p.transfer),
                fmt_seconds(p.step),
            )
            mark = "  <- this budget" if p is here else ""
            lines.append("  ".join(f"{c:>11}" for c in cells) + mark)
        lines.append(
            "bytes: held on the device after forward; seconds: predicted per step of the blocks (what they count: "
            "Budget.summary())"
        )
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Write the curve as a PNG to ``path`` (requires matplotlib)."""
        try:
            import matplotlib
        except ImportError as e:
            raise ImportError("Budget.curve().plot() needs matplotlib: pip install matplotlib") from e

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [p.budget / 2**20 for p in self.points]
        ax.step(xs, [p.step * 1e3 for p in self.points], where="post", label="predicted step")
        ax.step(xs, [p.recompute * 1e3 for p in self.points], where="post", label="of it, recompute")
        ax.axvline(self.budget / 2**20, color="gray", linestyle="--", label="this budget")
        ax.set_xlabel("budget: activation memory on the device after forward (MiB)")
        ax.set_ylabel("predicted time per step (ms)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
