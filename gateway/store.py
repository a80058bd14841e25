"""Stored responses (the Responses API's `store`): an embedded SQLite database in the gateway's data
directory, bounded in count and age.

Each row keeps the response object as the client saw it, the input items it was created from, and
the whole conversation up to and including its output (as `gateway.conversation` turns), so
`previous_response_id` continues from one row without walking a chain. Writes are committed before
the response is returned (WAL, synchronous=NORMAL): a restart or crash after that loses nothing.
"""

from __future__ import annotations

import base64
import json
import sqlite3
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gateway.chat.images import from_base64
from gateway.conversation import Part, ToolCall, Turn

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,      -- the response object (JSON)
    input_items TEXT NOT NULL,   -- the request's input items, with ids (JSON list)
    turns TEXT NOT NULL          -- the conversation through this response's output (JSON list)
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created_at);
"""


def _part(p: Part) -> dict[str, Any]:
    """A part as JSON: an image as its base64 bytes (read back and checked as when it arrived)."""
    if p.image is None:
        return {"type": p.type, "text": p.text, "param": p.param}
    return {"type": p.type, "param": p.param, "image": base64.b64encode(p.image.data).decode()}


def turns_to_json(turns: tuple[Turn, ...]) -> str:
    return json.dumps([{**asdict(replace(t, parts=())), "parts": [_part(p) for p in t.parts]} for t in turns],
                      ensure_ascii=False)


def turns_from_json(text: str) -> tuple[Turn, ...]:
    out = []
    for t in json.loads(text):
        parts = tuple(Part(p["type"], p.get("text", ""), from_base64(p["image"]) if p.get("image") else None,
                           p.get("param", "")) for p in t.get("parts", ()))
        out.append(Turn(t["role"], parts, tuple(ToolCall(**c) for c in t.get("tool_calls", ())), t.get("tool_call_id")))
    return tuple(out)


class ResponseStore:
    """Thread-safe; call from a worker thread (`asyncio.to_thread`) on the event loop's behalf."""

    def __init__(self, path: Path, max_items: int = 10_000, max_age_s: float = 30 * 86400) -> None:
        self.path = path
        self.max_items = max_items
        self.max_age_s = max_age_s
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def put(self, rid: str, response: dict[str, Any], input_items: list[dict[str, Any]], turns: tuple[Turn, ...]) -> None:
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                                 (rid, now, json.dumps(response, ensure_ascii=False),
                                  json.dumps(input_items, ensure_ascii=False), turns_to_json(turns)))
                self._db.execute("DELETE FROM responses WHERE created_at < ?", (now - self.max_age_s,))
                self._db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at DESC "
                                 "LIMIT -1 OFFSET ?)", (self.max_items,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _row(self, rid: str, column: str) -> str | None:
        with self._lock:
            row = self._db.execute(f"SELECT {column}, created_at FROM responses WHERE id = ?", (rid,)).fetchone()  # noqa: S608
        if row is None or time.time() - row[1] > self.max_age_s:
            return None
        return str(row[0])

    def response(self, rid: str) -> dict[str, Any] | None:
        raw = self._row(rid, "response")
        return None if raw is None else dict(json.loads(raw))

    def input_items(self, rid: str) -> list[dict[str, Any]] | None:
        raw = self._row(rid, "input_items")
        return None if raw is None else list(json.loads(raw))

    def turns(self, rid: str) -> tuple[Turn, ...] | None:
        raw = self._row(rid, "turns")
        return None if raw is None else turns_from_json(raw)

    def delete(self, rid: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE id = ?", (rid,))
        return cur.rowcount > 0

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
