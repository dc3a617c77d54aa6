"""Checked settings: the constrained types wmo_trio's arguments and settings are made of,
the settings of an episode, and the one way a validation failure becomes a message a user
can act on (`validation_problem`, for settings and for every other model).

Every settings model is a strict pydantic model (a bool is never a number, a string never
an integer) whose fields describe what they accept; `validation_problem` turns a
`ValidationError` of one into one line that names each bad argument, what it must be, and
what it got.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticCustomError

from wmo_trio._budgets import DEFAULT_COMMAND_TIMEOUT_SEC as DEFAULT_COMMAND_TIMEOUT_SEC
from wmo_trio._budgets import DEFAULT_EPISODE_TIMEOUT_SEC as DEFAULT_EPISODE_TIMEOUT_SEC
from wmo_trio._budgets import MAX_COMMAND_TIMEOUT_SEC as MAX_COMMAND_TIMEOUT_SEC
from wmo_trio._text import show

MIN_CONTEXT_WINDOW = 1024

PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False,
                                         description="a finite positive number of seconds")]
NonNegativeSeconds = Annotated[float, Field(ge=0, allow_inf_nan=False,
                                            description="a finite number of seconds >= 0")]
PositiveInt = Annotated[int, Field(ge=1, description="a positive integer")]
CommandTimeout = Annotated[int, Field(ge=1, le=MAX_COMMAND_TIMEOUT_SEC,
                                      description=f"an integer in [1, {MAX_COMMAND_TIMEOUT_SEC}]")]
NonEmptyText = Annotated[str, Field(min_length=1, description="a non-empty string")]
# A model's context, in tokens: room for the output limit (half of it) and a prompt.
ContextWindow = Annotated[int | None, Field(ge=MIN_CONTEXT_WINDOW,
                                            description=f"null or an integer >= {MIN_CONTEXT_WINDOW}")]
TemplateName = Annotated[str, Field(pattern=r"\S", description="a non-empty template name or id")]


class Settings(BaseModel):
    """Base of every settings model: strict, frozen, no unknown keys."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")
    # What an unknown key is called in a message: a setting, or a caller's argument.
    settings_noun: ClassVar[str] = "setting"

    @classmethod
    def parse(cls, data: Mapping[str, Any], *, where: str = "") -> Any:
        """Validate `data`; a failure is a `ValueError` saying what to change. `where`
        prefixes the message (for example "anthropic provider: ")."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as error:
            raise ValueError(where + validation_problem(error, model=cls)) from None


class EpisodeSettings(Settings):
    """One episode's limits, checked by these rules however the episode is started.

    The harbor agent takes them as `episode_timeout_sec` and `context_window`, and so does
    every runtime; the research API's keyword for the budget is `episode_timeout`, an alias
    of the one field, so that a failure names the argument its caller was given.
    """

    episode_timeout_sec: PositiveSeconds = Field(
        default=DEFAULT_EPISODE_TIMEOUT_SEC,
        validation_alias=AliasChoices("episode_timeout_sec", "episode_timeout"))
    context_window: ContextWindow = None


def refused(message: str) -> PydanticCustomError:
    """For a validator to raise: a failure whose `message` says what is wrong and what to do.
    `validation_problem` puts the argument's name in front and never quotes the value back
    (it may be a whole document, or a secret)."""
    return PydanticCustomError("refused", "{message}", {"message": message})


def not_given() -> PydanticCustomError:
    """For a validator of a required argument whose caller passes None for "not given"."""
    return PydanticCustomError("missing", "Field required")


def validation_problem(
    error: ValidationError,
    *,
    model: type[BaseModel] | None = None,
    whole: str | None = None,
    where: Callable[[tuple[int | str, ...]], str] | None = None,
    most: int | None = None,
) -> str:
    """One line for a failed validation: each problem as `where: what`, joined by "; ".

    With `model` (a settings model), a bad field says what it must be (its description)
    and what it got, a missing one what to pass, an unknown one the closest known name.
    `whole` names the value itself, for a problem of the value as a whole (its message
    alone when None); `where` names a location (default `location_name`); past `most`
    problems, a count of the others. pydantic's "Value error, " prefix is dropped.
    """
    problems = []
    for item in error.errors():
        location = tuple(item["loc"])
        name = (where or location_name)(location) if location else \
            whole or (model.__name__ if model is not None else "")
        message = item["msg"].removeprefix("Value error, ")
        if model is not None:
            problems.append(_settings_problem(model, item, name, location, message))
        else:
            problems.append(f"{name}: {message}" if name else message)
    shown = problems if most is None else problems[:most]
    if len(problems) > len(shown):
        shown.append(f"and {len(problems) - len(shown)} more problems")
    return "; ".join(shown)


_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,40}")


def location_name(location: tuple[int | str, ...]) -> str:
    """A location in validated data as a message names it: `a.0.b`, a key that is not a
    plain name quoted and cut (a hostile key can be anything, and long)."""
    return ".".join(str(part) if isinstance(part, int) or _PLAIN_NAME.fullmatch(part)
                    else show(part) for part in location)


def _settings_problem(model: type[BaseModel], item: ErrorDetails, name: str,
                      location: tuple[int | str, ...], message: str) -> str:
    parts = [str(part) for part in location]
    owner, field = _field_at(model, parts)
    description = _description(field) if field is not None else None
    if item["type"] == "extra_forbidden":
        return _unknown(name, parts[-1] if parts else name, owner)
    if item["type"] == "missing":
        return f"{name} is required" + (f": pass {description}" if description else "")
    if item["type"] == "refused":
        return f"{name}: {message}" if location else message
    if description:
        return f"{name} must be {description}, got {item['input']!r}"
    return f"{name}: {message}, got {item['input']!r}"


def _unknown(name: str, given: str, owner: type[BaseModel] | None) -> str:
    """An unknown name, with the known name closest to it (a misspelling is the usual
    cause) and the others."""
    # A model may keep fields it inherits, and refuses or ignores, out of what it offers.
    hidden: frozenset[str] = getattr(owner, "settings_not_offered", frozenset())
    known = sorted(set(owner.model_fields) - hidden) if owner is not None else []
    closest = difflib.get_close_matches(given, known, n=1, cutoff=0.6)
    hint = f" (did you mean {closest[0]}?)" if closest else ""
    noun = getattr(owner, "settings_noun", "setting")
    return f"unknown {noun} {name}{hint}; known: {', '.join(known) or 'none'}"


def _field_at(model: type[BaseModel], location: list[str]) -> tuple[type[BaseModel] | None, Any]:
    """The model that holds the field at `location` (nested settings models followed), and
    that field (None where the location is not a field). A field is found by its name or
    by any of its aliases."""
    owner: type[BaseModel] | None = model
    field = None
    for part in location:
        field = _field_named(owner, part) if owner is not None else None
        if field is None:
            return owner, None
        owner = next((kind for kind in (field.annotation, *getattr(field.annotation, "__args__", ()))
                      if isinstance(kind, type) and issubclass(kind, BaseModel)), None)
    return owner, field


def _field_named(model: type[BaseModel], name: str) -> FieldInfo | None:
    for field_name, field in model.model_fields.items():
        alias = field.validation_alias
        if name == field_name or (isinstance(alias, AliasChoices) and name in alias.choices):
            return field
    return None


def _description(field: FieldInfo) -> str | None:
    """What a field accepts: its own description, or that of the constrained type it may
    be None instead of (`TemplateName | None`)."""
    if field.description:
        return field.description
    for member in getattr(field.annotation, "__args__", ()):
        for metadata in getattr(member, "__metadata__", ()):
            if getattr(metadata, "description", None):
                return str(metadata.description)
    return None


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
