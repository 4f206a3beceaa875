"""The examples as a new user runs them: the quickstart prints its report and nothing else."""

import os
import re
import subprocess
import sys

import pytest
import torch

from support import DEVICES, ROOT

QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")

# Runs the quickstart as README command 1 does, in a venv without NumPy (pip install -e .
# does not install it): importing NumPy fails, as it does there.
_WITHOUT_NUMPY = f"import runpy, sys; sys.modules['numpy'] = None; runpy.run_path({QUICKSTART!r}, run_name='__main__')"

_MIB = r"\d+\.\d\d MiB"
_HEAD = [
    r"GPT: \d+ layers, d=\d+, \d+ heads, batch \d+ x \d+ tokens",
    r"variant\s+held after forward\s+peak fwd\+bwd\s+median step",
    rf"plain\s+(?P<plain_held>\d+\.\d\d) MiB\s+{_MIB}\s+\d+\.\d ms",
    rf"scoped\s+(?P<scoped_held>\d+\.\d\d) MiB\s+{_MIB}\s+\d+\.\d ms",
    r"activation memory saved by recompute_scope: \d+%",
    r"step time scoped / plain: \d+\.\d\dx \(median of 2 interleaved rounds after 0 warm-up rounds; "
    r"quartiles \d+\.\d\dx-\d+\.\d\dx\)",
]
_OPTIONAL = r"  \(the quartiles are far apart: other processes loaded this machine; rerun on an idle one\)"
_TAIL = [
    r"max \|grad difference\| after the first backward: (?P<diff>\S+)",
    r"losses identical in all 3 steps: (?P<same>True|False)",
    r"losses  plain: \[[-\d., ]+\] \.\.\.",
    r"losses scoped: \[[-\d., ]+\] \.\.\.",
    r"",
]
_REPORT_TITLE = rf"(plain|scoped): autograd stores {_MIB}; recompute handles stand for {_MIB}"
_TABLE = [
    r"module\s+op\s+count\s+activations\s+recomputable\s+params\s+largest saved",
    r"[- ]+",
    r"\S+\s+\S+\s+\d+\s+.*",  # a row
    r"total\s+\d+\s+.*",
    r"\.\.\. \d+ more rows\s+\d+\s+.*",
    r"held by scopes for replay \(not saved by autograd\): .*",
]


def _run_quickstart(device: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KINETO", "PYTHONWARNINGS"))}
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_NUMPY, "--rounds", "2", "--warmup", "0", "--device", device],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_quickstart_prints_its_report_and_nothing_else(device):
    proc = _run_quickstart(device)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Nothing on stderr: no NumPy warning from torch's import, no profiler (kineto) lines.
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    expected = [*_HEAD]
    if len(lines) > len(_HEAD) and re.fullmatch(_OPTIONAL, lines[len(_HEAD)]):
        expected.append(_OPTIONAL)
    expected += _TAIL
    found: dict[str, str] = {}
    for pattern, line in zip(expected, lines):
        m = re.fullmatch(pattern, line)
        assert m is not None, f"{line!r} does not match {pattern!r}\n{proc.stdout}"
        found.update({k: v for k, v in m.groupdict().items() if v is not None})
    assert float(found["scoped_held"]) < float(found["plain_held"])
    if device == "cpu":  # bitwise on CPU
        assert found["diff"] == "0.0" and found["same"] == "True"
    # Then the two saved-tensor reports: a title and a table each, nothing else.
    rest = lines[len(expected) :]
    titles = [i for i, line in enumerate(rest) if re.fullmatch(_REPORT_TITLE, line)]
    assert [rest[i].split(":")[0] for i in titles] == ["plain", "scoped"] and titles[0] == 0
    for i, line in enumerate(rest):
        if i in titles or (line == "" and i + 1 in titles):
            continue
        assert any(re.fullmatch(p, line) for p in _TABLE), f"unexpected line {line!r}\n{proc.stdout}"
    assert not re.search(r"warn|USDT|NumPy", proc.stdout, re.IGNORECASE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_quickstart_cuda_probe_reads_the_allocator():
    # On CUDA the probe uses the allocator's public counters: a known pattern, exactly.
    sys.path.insert(0, os.path.dirname(QUICKSTART))
    try:
        import quickstart as qs
    finally:
        sys.path.remove(os.path.dirname(QUICKSTART))
    mib = 2**20
    device = torch.device("cuda")

    def forward():
        return [torch.empty(mib, dtype=torch.uint8, device=device) for _ in range(2)]

    def backward(kept):
        kept.clear()
        torch.empty(mib + mib // 2, dtype=torch.uint8, device=device)

    _, held, peak = qs.profile_memory(forward, backward, device)
    assert (held, peak) == (2 * mib, 2 * mib)
