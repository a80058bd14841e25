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
            out["X-Ignored-Fields"] = ", ".join(sorted(self.ignored))
        if self.skipped_tools:
            out["X-Skipped-Tools"] = ", ".join(sorted(self.skipped_tools))
        return out
