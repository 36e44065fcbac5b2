"""What every `pipemem validate <target>` shows while it runs and when it ends.

* `CaseProgress`: a progress bar over the target's cases on the terminal (rich: bar, case
  count, the case running, elapsed time); in a log (stderr not a terminal) one line per case
  as it finishes. It writes to its own copy of stderr, so `quiet_profiler_chatter` never
  swallows it.
* `quiet_profiler_chatter()`: torch's profiler (Kineto) prints `USDT: ... profiler_start /
  profiler_stop` from C++ straight to file descriptor 2 on every profiled step; no setting
  turns it off. Inside this context fd 2 goes through a filter that drops those lines and
  passes everything else (warnings, errors) on.
* `print_summary(rows, ...)`: the closing table: one row per `compare.CaseRow` (or its dict),
  measured, estimated, rel_error, plus the target's own columns, and the worst |rel_error|.

    with quiet_profiler_chatter(), CaseProgress([c.name for c in cases], "validate cpu") as bar:
        for case in cases:
            bar.start(case.name)
            rows += run(case)
            bar.done(case.name)
    print_summary(rows, title="validate cpu")
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Sequence

from .compare import exit_code, header_line, max_abs_rel_error, report, verdict_line

CHATTER_PREFIXES = (b"USDT:",)


@contextmanager
def quiet_profiler_chatter(prefixes: tuple[bytes, ...] = CHATTER_PREFIXES):
    """Drop lines starting with `prefixes` that anything in this process (C++ included)
    writes to fd 2; everything else reaches stderr as before, in order."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real fd 2 (embedded, captured)
        yield
        return
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)

    def pump() -> None:
        pending = b""
        while True:
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            kept = [ln + b"\n" for ln in lines if not ln.startswith(prefixes)]
            if kept:
                _write(saved, b"".join(kept))
        if pending and not pending.startswith(prefixes):
            _write(saved, pending)
        os.close(read_fd)

    thread = threading.Thread(target=pump, name="pipemem-stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        try:
            sys.stderr.flush()
        except ValueError:
            pass
        os.dup2(saved, 2)  # closes our write end: the pump sees EOF once no child holds one
        thread.join(timeout=5)
        if not thread.is_alive():  # else a child still writes: leave `saved` open for the pump
            os.close(saved)


def _write(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:
        pass


class CaseProgress:
    """Progress over named cases: a rich bar on a terminal, one line per case in a log."""

    def __init__(self, names: Sequence[str], title: str, file=None, enabled: bool = True):
        self.names = list(names)
        self.title = title
        self.enabled = enabled and bool(self.names)
        self._file = file
        self._own_file = None
        self._progress = None
        self._task = None
        self._done = 0
        self._running = False
        self._t0 = self._t_case = time.perf_counter()

    # -- context
    def __enter__(self) -> "CaseProgress":
        if not self.enabled:
            return self
        if self._file is None:
            try:
                sys.stderr.flush()
                self._own_file = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1)
                self._file = self._own_file
            except (OSError, ValueError, AttributeError):
                self._file = sys.stderr
        if self._file.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]{task.fields[title]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=Console(file=self._file),
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task("", total=len(self.names), title=self.title)
        else:
            self._line(f"{self.title}: {len(self.names)} case{'s' if len(self.names) != 1 else ''}")
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self.enabled and self._file is not None:
            self._line(
                f"{self.title}: {self._done} of {len(self.names)} done in "
                f"{time.perf_counter() - self._t0:.1f} s"
            )
        if self._own_file is not None:
            self._own_file.close()

    # -- events
    def start(self, name: str) -> None:
        """`name` is running now (shown beside the bar); a second start before `done`
        only changes the text (the case's clock keeps running)."""
        if not self._running:
            self._t_case = time.perf_counter()
        self._running = True
        if self._progress is not None:
            self._progress.update(self._task, description=name)

    def done(self, name: str, note: str = "") -> None:
        """`name` finished; `note` (e.g. its error) goes into the log line."""
        self._done += 1
        self._running = False
        if self._progress is not None:
            self._progress.update(self._task, advance=1, description=name)
        elif self.enabled:
            seconds = time.perf_counter() - self._t_case
            self._line(
                f"[{self._done}/{len(self.names)}] {name} ({seconds:.1f} s){' ' + note if note else ''}"
            )
        self._t_case = time.perf_counter()

    def _line(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, highlight=False)
        else:
            print(text, file=self._file, flush=True)

    def run(self, items: Iterable, name_of: Callable[[object], str], fn: Callable[[object], list]) -> list:
        """`fn(item)` for each item, in order, with the bar following; the rows concatenated."""
        rows: list = []
        for item in items:
            self.start(name_of(item))
            rows += fn(item)
            self.done(name_of(item))
        return rows


def print_summary(
    rows,
    title: str = "",
    columns: Sequence[tuple[str, str]] = (),
    file=None,
    signed: Callable[[object], bool] | None = None,
    what: str = "cases",
    truth: str | None = None,
    tolerance: float | None = None,
    target: str = "",
) -> float | None:
    """The closing table of a validate target: case, measured, estimated, rel_error, then the
    target's own `columns` ((key, header) pairs; byte counts formatted), and one line with the
    worst |rel_error|. `signed(name)`: whether that row's bytes are a change (+/-). With `truth`
    and `tolerance` (compare.TRUTHS) the table's title says what "measured" is and the
    tolerance, and a last line the verdict (compare.verdict_line). Returns that worst error
    (None when no row has one)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from ..report.text import terminal_width
    from ..units import fmt_bytes

    file = file or sys.stdout
    if truth is not None:
        head = header_line(target, truth, tolerance)
        title = f"{head}\n{title}" if title else head
    t = Table(
        title=title or None,
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    t.add_column("case", no_wrap=True, overflow="fold")
    for h in ("measured", "estimated", "rel_error"):
        t.add_column(h, justify="right", no_wrap=True)
    for _, h in columns:
        t.add_column(h, no_wrap=True, overflow="fold")

    def b(row, v):
        if v is None:
            return "-"
        if isinstance(v, int) and not isinstance(v, bool):
            return fmt_bytes(v, signed=bool(signed and signed(str(row.get("name")))))
        return str(v)

    for r in rows:
        err = r.get("rel_error")
        cells = [
            str(r.get("name")),
            b(r, r.get("measured_bytes")),
            b(r, r.get("estimated_bytes")),
            ("n/a" if err is None else f"{err * 100:+.2f}%") + (" gap" if r.get("known_gap") else ""),
        ]
        for key, _ in columns:
            v = r.get(key)
            cells.append(
                b(r, v)
                if key.endswith("bytes")
                else ("-" if v is None else f"{v * 100:+.2f}%" if key.endswith("rel_error") else str(v))
            )
        t.add_row(*cells)
    con = Console(file=file, width=max(terminal_width(file), 100), highlight=False, soft_wrap=False)
    con.print(t)
    worst = max_abs_rel_error(rows)
    count = sum(1 for r in rows if r.get("rel_error") is not None)
    con.print(f"max |rel_error| = {'n/a' if worst is None else f'{worst * 100:.3f}%'} over {count} {what}")
    if truth is not None:
        con.print(verdict_line(rows, tolerance), markup=False)
    return worst


def print_result(
    rows, as_json: bool, target: str, truth: str, tolerance: float, json_fields: dict, **summary
) -> int:
    """What a validate target prints for its rows: with --json the report object (compare.report,
    with the target's own `json_fields`), else the summary table (print_summary's `summary`
    keywords). Returns the target's exit status (compare.exit_code)."""
    import json

    if as_json:
        print(json.dumps(report(target, truth, tolerance, rows, **json_fields), indent=1))
    else:
        print_summary(rows, target=target, truth=truth, tolerance=tolerance, **summary)
    return exit_code(rows, tolerance)
