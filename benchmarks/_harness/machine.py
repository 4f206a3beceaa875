"""What the numbers were measured on: CPU, cores, threads, versions, git commit, load."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Iterable
from typing import Any

import torch

import gradient_scope

__all__ = ["load_average", "machine_info", "mark_end"]

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages, or None where the OS does not report them."""
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _git_commit() -> str | None:
    """Short HEAD of the repository, marked when gradient_scope/ has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "-C", _ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", _ROOT, "status", "--porcelain", "--", "gradient_scope"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + (" (gradient_scope/ modified)" if dirty else "")


def machine_info(device: str, packages: Iterable[str] = ()) -> dict[str, Any]:
    """CPU model, cores, threads, versions, git commit, date, load average at start (and
    GPU where ``device`` is CUDA). ``packages``: further distributions whose versions to
    record (e.g. ``transformers``)."""
    info: dict[str, Any] = {
        "cpu_model": _cpu_model() or platform.processor() or None,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gradient_scope": getattr(gradient_scope, "__version__", None),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    for name in packages:
        info[name] = _package_version(name)
    la = load_average()
    if la is not None:
        info["load_average_at_start"] = la
    commit = _git_commit()
    if commit is not None:
        info["git_commit"] = commit
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def mark_end(info: dict[str, Any]) -> None:
    """Record the load average at the end of the run in ``info`` (where the OS reports it)."""
    la = load_average()
    if la is not None:
        info["load_average_at_end"] = la
