"""One way for every benchmark to print its table and save its table and plot.

Each benchmark builds its rows, calls :func:`markdown_table` to print them, and
:func:`save_report` to write ``<out>/<name>.md`` and ``<out>/<name>.png`` side by side
(``out`` defaults to ``benchmarks/results`` in a clone, ``./asyncvec-results`` for an installed package); :func:`save_figure` writes any further plot. Plots use matplotlib's Agg backend, so no
display is needed.

Example:
    >>> import tempfile
    >>> from asyncvec.benchmarks.report import markdown_table, new_figure, save_report
    >>> table = markdown_table(["mode", "steps/s"], [["sync", 100.0], ["async", 250.0]])
    >>> print(table.splitlines()[2])
    | sync | 100 |
    >>> fig, ax = new_figure()
    >>> _ = ax.bar(["sync", "async"], [100.0, 250.0])
    >>> paths = save_report("example", table, fig, out_dir=tempfile.mkdtemp(), command="python benchmarks/x.py")
    >>> sorted(p.suffix for p in paths)
    ['.md', '.png']
"""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# In a clone the tables live beside the code; an installed package (asyncvec demo) writes where it is run from.
_BESIDE_THE_CODE = Path(__file__).resolve().parent / "results"
RESULTS_DIR = _BESIDE_THE_CODE if _BESIDE_THE_CODE.is_dir() else Path("asyncvec-results")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats get a width that suits their size, NaN shows as ``n/a``."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells, the table has {len(headers)} columns")
        lines.append("| " + " | ".join(_cell(value) for value in row) + " |")
    return "\n".join(lines)


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    """A matplotlib figure and its axes (Agg backend: works without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=ncols == 1)


def machine_line() -> str:
    """One line naming the machine and its load, to print beside every measurement."""
    import os

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{time.strftime('%Y-%m-%d %H:%M')}, {platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} cores, load {load:.1f}"
    )


def save_report(
    name: str,
    table: str,
    figure: Any | None = None,
    *,
    out_dir: str | Path | None = None,
    command: str = "",
    notes: str = "",
) -> list[Path]:
    """Writes ``<name>.md`` (command, machine line, table, notes) and ``<name>.png``; returns the paths."""
    folder = Path(out_dir) if out_dir is not None else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    parts = [f"# {name}", ""]
    if command:
        parts += [f"Command: `{command}`", ""]
    parts += [f"Machine: {machine_line()}", "", table, ""]
    if notes:
        parts += [notes, ""]
    md_path = folder / f"{name}.md"
    md_path.write_text("\n".join(parts), encoding="utf-8")
    paths = [md_path]
    if figure is not None:
        paths.append(save_figure(name, figure, out_dir=folder))
    return paths


def save_figure(name: str, figure: Any, *, out_dir: str | Path | None = None) -> Path:
    """Writes ``<out_dir>/<name>.png`` (a benchmark's second or third plot) and closes the figure."""
    import matplotlib.pyplot as plt

    folder = Path(out_dir) if out_dir is not None else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    png_path = folder / f"{name}.png"
    figure.tight_layout()
    figure.savefig(png_path, dpi=110)
    plt.close(figure)
    return png_path
