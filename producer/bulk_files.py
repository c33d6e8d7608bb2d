"""The files of a bulk run: JSONL rows in; results and errors out, in input order; resumable.

Input: one JSON object per line with a `custom_id` and the keys its kind reads (`bulk_kinds`: a score
row's prompt and candidates, a generation's prompt or messages and options); other keys are ignored, so
a dataset may carry its own columns. A line that is not such an object becomes an error record with its
line number; it never stops the run. Output: one line per finished row, written only once every line
before it is decided, so a file cut short by Ctrl-C or a crash is a clean prefix of the input order. A
rerun reads that prefix back (dropping a half-written last line) and skips those rows.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TextIO

from pydantic import ValidationError

from mlxq import jobs

from .bulk_kinds import BadRow, BulkKind

log = logging.getLogger(__name__)

BulkSource = str | os.PathLike[str] | Iterable[Mapping[str, Any] | str | bytes]
"""A JSONL file's path, or rows: mappings, or JSON texts (one object each)."""

_TAIL_CHUNK = 1 << 16


class RowState(Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(eq=False)
class Slot:
    """One input line on its way out: a row still to run (its kind's request part), or a line already
    decided."""

    line: int  # 1-based line of the file (or position in the iterable)
    custom_id: str | None
    row: Any = None
    state: RowState = RowState.PENDING
    result: Any = None
    error: str = ""

    @classmethod
    def bad(cls, line: int, custom_id: str | None, reason: str) -> Slot:
        """A line that is not a row to run."""
        return cls(line, custom_id, state=RowState.FAILED, error=reason)

    def finished(self, result: Any) -> None:
        self.state, self.result = RowState.DONE, result

    def failed(self, reason: str) -> None:
        self.state, self.error = RowState.FAILED, reason


# --- input -----------------------------------------------------------------------------------------


class RowReader:
    """Every non-blank line of a JSONL file (or item of an iterable) as a `Slot`, in order.

    A path is opened (and its lines counted, for the progress bar) when the reader is made, so a missing
    file fails before anything is written. `first_line` maps each custom_id to where it first appeared.
    """

    def __init__(self, source: BulkSource, kind: BulkKind) -> None:
        self.source = source
        self.kind = kind
        self.first_line: dict[str, int] = {}
        self.read = 0
        self.total: int | None = None
        if isinstance(source, str | os.PathLike):
            with open(source, "rb") as f:
                self.total = sum(1 for raw in f if raw.strip())
        elif isinstance(source, Sized):
            self.total = len(source)

    def __iter__(self) -> Iterator[Slot]:
        for line, raw in self._raw_items():
            self.read += 1
            yield self._parse(line, raw)

    def _raw_items(self) -> Iterator[tuple[int, object]]:
        if isinstance(self.source, str | os.PathLike):
            with open(self.source, "rb") as f:
                for line, raw in enumerate(f, 1):
                    if raw.strip():
                        yield line, raw
        else:
            yield from enumerate(self.source, 1)

    def _parse(self, line: int, raw: object) -> Slot:
        obj = _decode(raw)
        if isinstance(obj, str):
            return Slot.bad(line, None, obj)
        custom_id = obj.get("custom_id")
        if custom_id is None:
            return Slot.bad(line, None, "missing custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            return Slot.bad(line, None, f"custom_id must be a non-empty string, got {custom_id!r}")
        first = self.first_line.setdefault(custom_id, line)
        if first != line:
            return Slot.bad(line, custom_id, f"duplicate custom_id {custom_id!r} (first on line {first})")
        try:
            row = self.kind.row(obj)
        except ValidationError as e:
            return Slot.bad(line, custom_id, jobs.describe_validation_error(self.kind.name, e))
        except BadRow as e:
            return Slot.bad(line, custom_id, str(e))
        return Slot(line, custom_id, row)


def _decode(raw: object) -> dict[str, Any] | str:
    """The JSON object of an input item, or (a str) why it is not one."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return f"not UTF-8 text (byte {e.start})"
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            return f"not valid JSON: {e.msg} at column {e.colno}"
    if not isinstance(raw, Mapping):
        return f"expected a JSON object, got {type(raw).__name__}"
    return dict(raw)


# --- resuming --------------------------------------------------------------------------------------


@dataclass
class Resume:
    """What an earlier run left: rows already in the output (and, if errors are not retried, failed)."""

    done: set[str] = field(default_factory=set)
    failed_ids: set[str] = field(default_factory=set)
    failed_lines: set[int] = field(default_factory=set)

    def mark(self, slot: Slot) -> Slot:
        """Mark `slot` skipped if an earlier run decided it already."""
        if slot.row is not None:
            decided = slot.custom_id in self.done or slot.custom_id in self.failed_ids
        else:  # a line that is no row: by its number, or its custom_id where the errors file has no numbers
            decided = slot.line in self.failed_lines or (
                slot.custom_id is not None and slot.custom_id in self.failed_ids
            )
        if decided:
            slot.state = RowState.SKIPPED
        return slot


def load_resume(out_path: Path, errors_path: Path, retry_errors: bool) -> Resume:
    """Read what earlier runs wrote. With `retry_errors`, the old errors file is removed (retried now)."""
    resume = Resume(done={r["custom_id"] for r in _records(out_path) if isinstance(r.get("custom_id"), str)})
    if retry_errors:
        errors_path.unlink(missing_ok=True)
        return resume
    for record in _records(errors_path):
        if isinstance(record.get("custom_id"), str):
            resume.failed_ids.add(record["custom_id"])
        if isinstance(record.get("line"), int):
            resume.failed_lines.add(record["line"])
    return resume


def _records(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    drop_partial_last_line(path)
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                log.warning("unreadable line ignored path=%s line=%d", path, n)
                continue
            if isinstance(record, dict):
                yield record


def drop_partial_last_line(path: Path) -> None:
    """Cut a last line that has no newline (the run was killed while writing it)."""
    with open(path, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        pos = end
        while pos > 0:
            start = max(0, pos - _TAIL_CHUNK)
            f.seek(start)
            newline = f.read(pos - start).rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                break
            pos = start
        else:
            f.truncate(0)
        log.warning("dropped a half-written last line path=%s", path)


def restore_order(path: Path, first_line: Mapping[str, int]) -> bool:
    """Rewrite `path` in input order if a rerun appended rows that belong earlier; True if it did.

    That happens when rows that failed before succeed on a rerun. Lines whose custom_id is not in the
    input go last. The rewrite is a new file renamed over the old one, so it is never half done.
    """
    spans: list[tuple[float, int, int]] = []
    with open(path, "rb") as f:
        offset = 0
        for raw in f:
            spans.append((first_line.get(_custom_id(raw), math.inf), offset, len(raw)))
            offset += len(raw)
    if all(a[0] <= b[0] for a, b in itertools.pairwise(spans)):
        return False
    tmp = path.with_name(path.name + ".reorder")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for _, start, size in sorted(spans, key=lambda s: s[0]):
            src.seek(start)
            dst.write(src.read(size))
    os.replace(tmp, path)
    log.info("output put back in input order path=%s rows=%d", path, len(spans))
    return True


def _custom_id(raw: bytes) -> str:
    try:
        record = json.loads(raw)
    except json.JSONDecodeError:
        return ""
    return str(record.get("custom_id", "")) if isinstance(record, dict) else ""


# --- output ----------------------------------------------------------------------------------------


@dataclass
class Counts:
    """Rows written by this run so far."""

    succeeded: int = 0
    failed: int = 0
    skipped: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0

    @property
    def decided(self) -> int:
        return self.succeeded + self.failed + self.skipped


class OrderedOutput:
    """Holds rows from the first undecided one on; writes each decided line only once all before it are.

    The errors file is opened on its first error, so a clean run leaves none behind.
    """

    def __init__(self, out: TextIO, errors_path: Path, kind: BulkKind) -> None:
        self.out = out
        self.kind = kind
        self.errors_path = errors_path
        self.counts = Counts()
        self._errors: TextIO | None = None
        self._window: deque[Slot] = deque()

    def __len__(self) -> int:
        return len(self._window)

    def add(self, slot: Slot) -> None:
        self._window.append(slot)

    def commit(self) -> None:
        """Write every decided line at the front of the window, then flush."""
        wrote = False
        while self._window and self._window[0].state is not RowState.PENDING:
            self._write(self._window.popleft())
            wrote = True
        if wrote:
            self.out.flush()
            if self._errors is not None:
                self._errors.flush()

    def close(self) -> None:
        if self._errors is not None:
            self._errors.close()

    def _write(self, slot: Slot) -> None:
        c = self.counts
        if slot.state is RowState.SKIPPED:
            c.skipped += 1
        elif slot.state is RowState.DONE and slot.result is not None:
            record = {"custom_id": slot.custom_id, **self.kind.record(slot.result, slot.row)}
            self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
            tokens = self.kind.tokens(slot.result)
            c.succeeded += 1
            c.input_tokens += tokens.input
            c.cached_tokens += tokens.cached
            c.generated_tokens += tokens.generated
        else:
            if self._errors is None:
                self._errors = open(self.errors_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            record = self.kind.error_record(slot.custom_id, slot.line, slot.error, slot.row is not None)
            self._errors.write(json.dumps(record, ensure_ascii=False) + "\n")
            c.failed += 1


@dataclass(frozen=True)
class BulkSummary:
    """What a bulk run did. `rows` counts input lines read; rows not decided when it was interrupted
    are `unfinished` (a rerun runs them)."""

    rows: int
    succeeded: int
    failed: int
    skipped: int
    input_tokens: int
    cached_tokens: int
    jobs: int
    wall_s: float
    interrupted: bool
    out_path: Path
    errors_path: Path
    generated_tokens: int = 0

    @property
    def unfinished(self) -> int:
        return self.rows - self.succeeded - self.failed - self.skipped

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def generated_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def rows_per_s(self) -> float:
        """Rows decided by this run (finished or failed, not skipped) per second of wall time."""
        return (self.succeeded + self.failed) / self.wall_s if self.wall_s > 0 else 0.0

    def render(self) -> str:
        """A few lines for a person."""
        lines = [
            f"rows {self.rows:,}: {self.succeeded:,} succeeded, {self.failed:,} failed, "
            f"{self.skipped:,} skipped (done before)",
            f"tokens {self.input_tokens:,} input, {self.cached_tokens:,} cached ({self.cached_share:.1%})"
            + (
                f", {self.generated_tokens:,} generated ({self.generated_per_s:,.1f}/s)"
                if self.generated_tokens
                else ""
            ),
            f"jobs {self.jobs:,} in {self.wall_s:.1f} s: {self.rows_per_s:,.1f} rows/s",
            f"output {self.out_path}" + (f"; errors {self.errors_path}" if self.failed else ""),
        ]
        if self.interrupted:
            lines.append(f"interrupted: {self.unfinished:,} rows unfinished; run again to resume")
        return "\n".join(lines)


def default_errors_path(out_path: str | Path) -> Path:
    """`out.jsonl` → `out.errors.jsonl`."""
    out = Path(out_path)
    return out.with_name(out.stem + ".errors" + (out.suffix or ".jsonl"))
