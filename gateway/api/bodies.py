"""Typed request bodies shared by the protocol adapters: unions told apart by a `type` whose errors
name a field as the protocol names it, and the fields a body carried that its model does not define.

A discriminated union puts the member it chose in an error's location (`content.1.text.text`); the
validators here take it out, so a client reads `messages[0].content[1].text`, and an unknown or
missing `type` is an error at `.type` that lists the types there are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError


def tagged(kind: str, tags: Sequence[str]) -> WrapValidator:
    """A validator for an `Annotated` union of models told apart by `type` (`tags`, in the order
    errors list them); `kind` names a member in errors ("content block", "tool_choice")."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            errors = [_untagged(e, kind, tags) for e in exc.errors()]
            raise ValidationError.from_exception_data(exc.title, errors) from None

    return WrapValidator(validate)


def _untagged(e: ErrorDetails, kind: str, tags: Sequence[str]) -> InitErrorDetails:
    loc, kind_of_error, value = tuple(e["loc"]), e["type"], e["input"]
    if loc and loc[0] in tags:  # the member the union chose
        loc = loc[1:]
    if not loc and kind_of_error in ("union_tag_invalid", "union_tag_not_found") and isinstance(value, dict):
        if value.get("type") is None:
            return {"type": PydanticCustomError("missing", "Field required"), "loc": ("type",), "input": value}
        error = PydanticCustomError("invalid_value", f"unknown {kind} type {value['type']!r}; expected one of: "
                                                     f"{', '.join(tags)}")
        return {"type": error, "loc": ("type",), "input": value["type"]}
    if not loc and kind_of_error in ("union_tag_invalid", "union_tag_not_found", "model_attributes_type",
                                     "model_type", "dict_type"):
        return {"type": PydanticCustomError("invalid_type", f"a {kind} must be an object"), "loc": (),
                "input": value}
    return {"type": PydanticCustomError(kind_of_error, e["msg"]), "loc": loc, "input": value}


def text_or_list(value: Any) -> str | None:
    """The `Discriminator` of `str | list[...]` (a content field): the member the value is, so an
    error names only that member's problem; neither is an error of its own."""
    if isinstance(value, str):
        return "str"
    return "list" if isinstance(value, list) else None


def type_of(default: str, known: Sequence[str], other: str) -> Callable[[Any], str | None]:
    """The `Discriminator` of a union whose `type` may be absent (`default`): `default` for the
    `known` types, `other` for any other type."""

    def tag(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return default if kind is None or kind in known else other

    return tag


def unknown_fields(model: BaseModel, path: str = "") -> Iterator[str]:
    """Where `model` and the models it holds carried fields they do not define (kept by
    `extra="allow"`), as the protocol names them: `context_management`, `messages[2].tool_call_id`."""
    for key in model.model_extra or {}:
        yield f"{path}.{key}" if path else key
    for name in model.model_fields_set:
        yield from _unknown_in(getattr(model, name, None), f"{path}.{name}" if path else name)


def _unknown_in(value: Any, path: str) -> Iterator[str]:
    if isinstance(value, BaseModel):
        yield from unknown_fields(value, path)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _unknown_in(item, f"{path}[{i}]")
