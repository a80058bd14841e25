"""A small JSON object kept in a file of the model cache (the functional checks' verdicts, the
capability reports): read whole, written whole through a temporary file that replaces it, so a
reader sees the old object or the new one, never half of one. A missing or unreadable file reads
as an empty object."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class JsonFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def set(self, key: str, value: Any) -> None:
        """Write `key`, the rest of the object as it is now."""
        data = self.read()
        data[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")  # one per writing process
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
