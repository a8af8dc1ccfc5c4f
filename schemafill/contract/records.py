"""Reading and writing ToolRequest JSONL files, with a ledger of what was rejected.

Bad input loses nothing: every malformed record is named (file, line, id, reason),
skipped and counted, and the good ones are kept; ``strict=True`` makes the first bad
record fatal instead.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from schemafill import atomic
from schemafill.contract.toolcall import InvalidRequest, ToolRequest


@dataclass(frozen=True)
class Rejected:
    source: str  # file or corpus name
    line: int | None  # 1-based line number, when the source has lines
    id: str | None
    reason: str

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}" if self.line is not None else self.source
        return f"{where} (id={self.id}): {self.reason}"


@dataclass
class RejectLog:
    """Rejected records of one load; ``strict`` turns the first into an error."""

    strict: bool = False
    items: list[Rejected] = field(default_factory=list)

    def add(self, source: str, line: int | None, rid: str | None, reason: str) -> None:
        item = Rejected(source, line, rid, reason)
        if self.strict:
            raise InvalidRequest(f"strict mode: {item}")
        self.items.append(item)

    def __len__(self) -> int:
        return len(self.items)

    def counts(self) -> dict[str, int]:
        """Rejections per reason (reasons with per-record detail are grouped by their head)."""
        return dict(Counter(r.reason.split(":")[0] for r in self.items))

    def summary(self, limit: int = 5) -> str:
        if not self.items:
            return "no records rejected"
        lines = [f"{len(self.items)} records rejected: {self.counts()}"]
        lines += [f"  {r}" for r in self.items[:limit]]
        if len(self.items) > limit:
            lines.append(f"  ... and {len(self.items) - limit} more")
        return "\n".join(lines)


def json_lines(path: str | os.PathLike, log: RejectLog | None = None) -> Iterator[tuple[int, Any]]:
    """``(line number, record)`` of every non-blank line of a JSON-lines file. A line that is not
    UTF-8 or not JSON is named in ``log`` and skipped; without a log it is an error."""
    path = Path(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                record = json.loads(line)
            except ValueError as e:  # UnicodeDecodeError and JSONDecodeError alike
                if log is None:
                    raise ValueError(f"{path}:{lineno}: {e}") from e
                log.add(str(path), lineno, None, f"{'not UTF-8' if isinstance(e, UnicodeDecodeError) else 'not JSON'}: {e}")
                continue
            yield lineno, record


def read_requests(path: str | os.PathLike, log: RejectLog | None = None) -> tuple[list[ToolRequest], RejectLog]:
    """Load a ToolRequest JSONL file; a record without an id is named by file and line."""
    log = log if log is not None else RejectLog()
    path = Path(path)
    out: list[ToolRequest] = []
    for lineno, record in json_lines(path, log):
        rid = record.get("id") if isinstance(record, dict) else None
        if isinstance(record, dict) and rid is None:
            record = {**record, "id": f"{path.stem}:{lineno}"}
        try:
            out.append(ToolRequest.from_dict(record))
        except InvalidRequest as e:
            log.add(str(path), lineno, rid, str(e))
    return out, log


def evenly(items: list, n: int) -> list:
    """``n`` of ``items`` (all, when fewer), evenly spaced over them, in their order: request
    files are grouped by category, so the first n would be one category."""
    n = min(n, len(items))
    return [items[i * len(items) // n] for i in range(n)]


def spread(items: list, n: int) -> list:
    """``evenly``'s choice reordered so that every prefix is spread too (bit-reversed order): a
    bench level that takes the first m of them takes a spread sample."""
    chosen = evenly(items, n)
    if not chosen:
        return []
    bits = max(1, (len(chosen) - 1).bit_length())
    order = sorted(range(1 << bits), key=lambda i: int(f"{i:0{bits}b}"[::-1], 2))
    return [chosen[i] for i in order if i < len(chosen)]


def write_requests(path: str | os.PathLike, requests: list[ToolRequest]) -> None:
    atomic.write_jsonl(path, [r.to_dict() for r in requests])
