"""Reading a results stream (``results.jsonl``): its rows, whole case blocks, a clear error for what is not one.

Dictionaries only, no torch: what reads runs without running a case (``compare-runs``, ``calibrate``, ``bisect``, the
JUnit writer, the bench) imports this, not :mod:`parity.run.results`, which builds :class:`~cases.case.Case`
objects (torch) and writes streams.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_rows(path: Path) -> list[dict]:
    """The rows of a ``results.jsonl`` in file order (:func:`parse_lines`: a torn line of a killed run is skipped)."""
    return parse_lines(Path(path).read_text(encoding="utf-8"))


def parse_lines(text: str) -> list[dict]:
    """The JSON object rows of a stream, skipping torn or foreign lines."""
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn line from a killed run
        if isinstance(row, dict) and "type" in row:
            rows.append(row)
    return rows


class StreamError(ValueError):
    """A results stream that cannot be read (missing, binary, not a dsv4-parity stream)."""


def read_stream(path: Path) -> list[dict]:
    """The rows of a ``results.jsonl`` (or of the one in a run directory); torn lines skipped. Raises
    :class:`StreamError` for a missing or binary file and one without a ``run`` row."""
    path = Path(path)
    path = path / "results.jsonl" if path.is_dir() else path
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StreamError(f"no results file at {path}") from None
    except OSError as exc:
        raise StreamError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise StreamError(f"{path} is not a results stream: binary or not UTF-8 text") from None
    rows = parse_lines(text)
    if not any(r.get("type") == "run" for r in rows):
        raise StreamError(f"{path} is not a dsv4-parity results stream (no 'run' row)")
    return rows


def case_blocks(rows: list[dict]) -> tuple[list[list[dict]], list[str]]:
    """``(whole case blocks, ids of cut-off cases)``: a block is a ``case`` row and the ``n_rows`` rows of that case
    right after it (a ``case`` row without ``n_rows``, from before it was recorded, counts as whole)."""
    blocks, cut = [], []
    i = 0
    while i < len(rows):
        head = rows[i]
        i += 1
        if head.get("type") != "case":
            continue
        body = []
        while i < len(rows) and rows[i].get("type") in ("tensor", "metric") and \
                rows[i].get("case_id") == head.get("case_id"):
            body.append(rows[i])
            i += 1
        expected = head.get("n_rows")
        if expected is None or expected == len(body):
            blocks.append([head, *body])
        else:
            cut.append(str(head.get("case_id")))
    return blocks, cut
