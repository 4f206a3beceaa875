"""Text tables of :class:`SavedTensorsReport`: one report, or two side by side."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .tally import SavedTensorsRow, group_rows

__all__ = ["Totals", "fmt_bytes", "table", "diff_table"]


class Totals(NamedTuple):
    """The byte totals of a report."""

    activation: int
    param: int
    recomputable: int
    held_by_scopes: int
    offloaded: int = 0  # moved to host memory by a budget
    collectives: tuple[tuple[str, int], ...] = ()  # (name, count) the saved handles' replays run


def fmt_bytes(n: int) -> str:
    sign, n = ("-", -n) if n < 0 else ("", n)
    if n < 1024:
        return f"{sign}{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if round(value, 2) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{sign}{value:.2f} {unit}"


def _largest(r: SavedTensorsRow) -> str:
    if r.largest_shape is None or r.largest_dtype is None:
        return ""
    dtype = str(r.largest_dtype).removeprefix("torch.")
    where = f" at {r.largest_source}" if r.largest_source else ""
    return f"{dtype}{list(r.largest_shape)}{where}"


def _key_columns(by: str | None) -> tuple[str, ...]:
    return {None: ("module", "op"), "op": ("op",), "module": ("module",), "layer": ("layer",), "class": ("class",)}[by]


def _key_values(r: SavedTensorsRow, by: str | None) -> tuple[str, ...]:
    return (r.module, r.op) if by is None else (r.op,) if by == "op" else (r.module,)


def _render(
    header: Sequence[str], lines: list[tuple[str, ...]], footer: list[tuple[str, ...]], left: int, left_last: bool
) -> str:
    """Columns before ``left`` (and the last one if ``left_last``) left-aligned, the rest right-aligned."""
    widths = [max(len(x[i]) for x in (header, *lines, *footer)) for i in range(len(header))]
    last = len(widths) - 1

    def fmt(cols: Sequence[str]) -> str:
        out = [
            c.ljust(w) if i < left or (left_last and i == last) else c.rjust(w)
            for i, (c, w) in enumerate(zip(cols, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *map(fmt, lines), rule, *map(fmt, footer)])


def table(rows: list[SavedTensorsRow], totals: Totals, by: str | None, top: int | None, params: bool) -> str:
    """One report as a table; ``params=False`` leaves parameter bytes out."""
    rows = group_rows(rows, by)
    if not params:
        rows = [r for r in rows if r.activation_bytes or r.recomputable_bytes]
    shown = rows if top is None else rows[:top]
    keys = _key_columns(by)
    header = (*keys, "count", "activations", "recomputable", *(("params",) if params else ()), "largest saved")
    pad = ("",) * (len(keys) - 1)

    def cols(first: tuple[str, ...], count: int, act: int, rec: int, par: int, largest: str) -> tuple[str, ...]:
        money = (fmt_bytes(act), fmt_bytes(rec), *((fmt_bytes(par),) if params else ()))
        return (*first, str(count), *money, largest)

    lines = [
        cols(_key_values(r, by), r.count, r.activation_bytes, r.recomputable_bytes, r.param_bytes, _largest(r))
        for r in shown
    ]
    rest = rows[len(shown) :]
    if rest:
        lines.append(
            cols(
                (f"... {len(rest)} more rows", *pad),
                sum(r.count for r in rest),
                sum(r.activation_bytes for r in rest),
                sum(r.recomputable_bytes for r in rest),
                sum(r.param_bytes for r in rest),
                "",
            )
        )
    count = sum(r.count for r in rows)
    footer = [cols(("total", *pad), count, totals.activation, totals.recomputable, totals.param, "")]
    text = _render(header, lines, footer, len(keys), True)
    text = f"{text}\nheld by scopes for replay (not saved by autograd): {fmt_bytes(totals.held_by_scopes)}"
    if totals.offloaded:
        text += f"\noffloaded to host memory by a budget (not on the device): {fmt_bytes(totals.offloaded)}"
    if totals.collectives:
        named = ", ".join(f"{name} x{n}" for name, n in totals.collectives)
        text += f"\ncollectives replayed in backward: {named}"
    return text


def diff_table(
    a: list[SavedTensorsRow],
    b: list[SavedTensorsRow],
    ta: Totals,
    tb: Totals,
    by: str | None,
    top: int | None,
    labels: tuple[str, str],
) -> str:
    """Two reports side by side, rows matched by key, largest change first."""
    ga = {_key_values(r, by): r for r in group_rows(a, by)}
    gb = {_key_values(r, by): r for r in group_rows(b, by)}
    keys = list(dict.fromkeys([*ga, *gb]))

    def stored(r: SavedTensorsRow | None) -> int:
        return 0 if r is None else r.stored_bytes

    def rec(r: SavedTensorsRow | None) -> int:
        return 0 if r is None else r.recomputable_bytes

    keys.sort(key=lambda k: (-abs(stored(gb.get(k)) - stored(ga.get(k))), -stored(ga.get(k)), k))
    shown = keys if top is None else keys[:top]
    la, lb = labels
    names = _key_columns(by)
    header = (*names, f"{la} stored", f"{la} recomputable", f"{lb} stored", f"{lb} recomputable", "change in stored")

    def cols(first: tuple[str, ...], sa: int, ra: int, sb: int, rb: int) -> tuple[str, ...]:
        return (*first, fmt_bytes(sa), fmt_bytes(ra), fmt_bytes(sb), fmt_bytes(rb), fmt_bytes(sb - sa))

    lines = [cols(k, stored(ga.get(k)), rec(ga.get(k)), stored(gb.get(k)), rec(gb.get(k))) for k in shown]
    pad = ("",) * (len(names) - 1)
    rest = keys[len(shown) :]
    if rest:
        lines.append(
            cols(
                (f"... {len(rest)} more rows", *pad),
                sum(stored(ga.get(k)) for k in rest),
                sum(rec(ga.get(k)) for k in rest),
                sum(stored(gb.get(k)) for k in rest),
                sum(rec(gb.get(k)) for k in rest),
            )
        )
    footer = [
        cols(("activations", *pad), ta.activation, ta.recomputable, tb.activation, tb.recomputable),
        cols(("params", *pad), ta.param, 0, tb.param, 0),
        cols(("held by scopes", *pad), ta.held_by_scopes, 0, tb.held_by_scopes, 0),
        *([cols(("offloaded", *pad), ta.offloaded, 0, tb.offloaded, 0)] if ta.offloaded or tb.offloaded else []),
        cols(
            ("kept in all", *pad),
            ta.activation + ta.param + ta.held_by_scopes + ta.offloaded,
            ta.recomputable,
            tb.activation + tb.param + tb.held_by_scopes + tb.offloaded,
            tb.recomputable,
        ),
    ]
    return _render(header, lines, footer, len(names), False)
