"""Checked settings: the constrained types wmo_trio's arguments and settings are made of,
and one way to turn a validation failure into a message a user can act on.

Every settings model is a strict pydantic model (a bool is never a number, a string never
an integer) whose fields describe what they accept; `settings_problem` turns a
`ValidationError` into one line that names each bad argument, what it must be, and what
it got.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

MAX_COMMAND_TIMEOUT_SEC = 240

PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False,
                                         description="a finite positive number of seconds")]
NonNegativeSeconds = Annotated[float, Field(ge=0, allow_inf_nan=False,
                                            description="a finite number of seconds >= 0")]
PositiveInt = Annotated[int, Field(ge=1, description="a positive integer")]
CommandTimeout = Annotated[int, Field(ge=1, le=MAX_COMMAND_TIMEOUT_SEC,
                                      description=f"an integer in [1, {MAX_COMMAND_TIMEOUT_SEC}]")]
NonEmptyText = Annotated[str, Field(min_length=1, description="a non-empty string")]


class Settings(BaseModel):
    """Base of every settings model: strict, frozen, no unknown keys."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    @classmethod
    def parse(cls, data: Mapping[str, Any], *, where: str = "") -> Any:
        """Validate `data`; a failure is a `ValueError` saying what to change. `where`
        prefixes the message (for example "anthropic provider: ")."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as error:
            raise ValueError(where + settings_problem(cls, error)) from None


def settings_problem(model: type[BaseModel], error: ValidationError) -> str:
    """One line for a failed validation of `model`: each bad field named, with what it
    must be (its description) and what it got."""
    problems = []
    for item in error.errors():
        location = [str(part) for part in item["loc"]]
        name = ".".join(location) or model.__name__
        owner, field = _field_at(model, location)
        if item["type"] == "extra_forbidden":
            known = ", ".join(sorted(owner.model_fields)) if owner is not None else "none"
            problems.append(f"unknown setting {name}; known: {known}")
        elif item["type"] == "missing":
            problems.append(f"{name} is required")
        elif field is not None and field.description:
            problems.append(f"{name} must be {field.description}, got {item['input']!r}")
        else:
            problems.append(f"{name}: {item['msg']}, got {item['input']!r}")
    return "; ".join(problems)


def _field_at(model: type[BaseModel], location: list[str]) -> tuple[type[BaseModel] | None, Any]:
    """The model that holds the field at `location` (nested settings models followed), and
    that field (None where the location is not a field)."""
    owner: type[BaseModel] | None = model
    field = None
    for part in location:
        if owner is None or part not in owner.model_fields:
            return owner, None
        field = owner.model_fields[part]
        owner = next((kind for kind in (field.annotation, *getattr(field.annotation, "__args__", ()))
                      if isinstance(kind, type) and issubclass(kind, BaseModel)), None)
    return owner, field


_ADAPTERS: dict[int, tuple[Any, TypeAdapter[Any]]] = {}


def checked(kind: Any, value: object, name: str) -> Any:
    """`value` validated (strictly) as the annotated type `kind`; a `ValueError` naming
    `name` and what it must be otherwise."""
    cached = _ADAPTERS.get(id(kind))
    if cached is None or cached[0] is not kind:
        cached = _ADAPTERS[id(kind)] = (kind, TypeAdapter(kind))
    try:
        result = cached[1].validate_python(value, strict=True)
    except ValidationError:
        description = next((m.description for m in getattr(kind, "__metadata__", ())
                            if getattr(m, "description", None)), "valid")
        raise ValueError(f"{name} must be {description}, got {value!r}") from None
    return result
