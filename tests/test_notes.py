"""What the gateway tells a client in headers (X-Ignored-Fields, X-Skipped-Tools) is built from the
client's own field and tool names: any text makes a header value HTTP accepts."""

from __future__ import annotations

import h11
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.notes import header_value


def _accepted(value: str) -> None:
    h11.Response(status_code=200, headers=[("x-ignored-fields", value.encode("latin-1"))])


@settings(max_examples=500, deadline=None)
@given(st.lists(st.text(), max_size=60), st.integers(min_value=8, max_value=2000))
def test_any_names_make_a_header_value_http_accepts(names: list[str], limit: int) -> None:
    value = header_value(", ".join(names), limit)
    _accepted(value)
    assert len(value) <= limit


def test_a_cut_list_says_so_and_ends_without_whitespace() -> None:
    names = [f"messages[{i}].field" for i in range(200)]
    value = header_value(", ".join(names), 1024)
    assert value.endswith("...") and len(value) <= 1024
    _accepted(value)
    # The cut of the fuzzed request that once broke a response: right after a separator.
    text = "a" * 1022 + ", b"
    _accepted(header_value(text, 1024))
    assert header_value("tool\x00name\n é", 64) == "tool?name ?"
