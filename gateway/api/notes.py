"""What a request asked for that the gateway accepted without honouring it, named in response
headers (any protocol): fields in `X-Ignored-Fields`, tools in `X-Skipped-Tools`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Notes:
    """What was accepted but not honoured, for the response headers."""

    ignored: set[str] = field(default_factory=set)
    skipped_tools: set[str] = field(default_factory=set)

    def headers(self) -> dict[str, str]:
        out = {}
        if self.ignored:
            out["X-Ignored-Fields"] = header_value(", ".join(sorted(self.ignored)))
        if self.skipped_tools:
            out["X-Skipped-Tools"] = header_value(", ".join(sorted(self.skipped_tools)))
        return out


def header_value(text: str, limit: int = 1024) -> str:
    """HTTP header values are Latin-1 and one line; field names and reasons are the client's free text."""
    flat = "".join(c if c.isprintable() else "?" for c in " ".join(text.split()))  # no control characters
    flat = flat.encode("ascii", "replace").decode()
    if len(flat) > limit:  # cut, and said to be (a value may not end in whitespace either)
        flat = flat[: limit - 3].rstrip() + "..."
    return flat.strip()
