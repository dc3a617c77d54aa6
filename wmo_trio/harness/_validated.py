"""Models that exist only validated: the copy and pickle guards every document model shares,
and the one way untrusted data becomes a model (`validate`: one `HarnessError` naming the
source and, for a document, the surface)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from wmo_trio._text import has_lone_surrogate, show
from wmo_trio.harness._limits import MAX_ID_CHARS, HarnessError
from wmo_trio.settings import location_name, validation_problem


class Validated(BaseModel):
    """A frozen model whose every instance went through validation.

    pydantic builds instances around validation in four places: `model_construct` and the
    deprecated `copy`, both refused here; `model_copy(update=...)` (and `copy.replace`),
    which here validates the copy as a new instance; and unpickling, which here validates
    the pickled fields as a new instance, so that a pickle edited or written by an older
    version gives the views of its own data, or a `HarnessError`. A copy without `update`
    (`copy.copy`, `copy.deepcopy`) has the data of a valid instance, so it stays valid.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __getstate__(self) -> dict[Any, Any]:
        # Only the fields: what is derived from them is derived again when loaded.
        return {**super().__getstate__(), "__pydantic_private__": None}

    def __setstate__(self, state: dict[Any, Any]) -> None:
        name = type(self).__name__
        fields = state.get("__dict__") if isinstance(state, Mapping) else None
        if not isinstance(fields, Mapping):
            raise HarnessError(f"unpickled {name} is invalid: its pickle holds no fields; "
                               f"pickle a {name} as pickle.dumps gives it")
        fresh = validate(type(self), dict(fields), f"unpickled {name}")
        super().__setstate__(fresh.__getstate__() | {
            "__pydantic_private__": fresh.__pydantic_private__,
            "__pydantic_fields_set__": _set_fields(state, fresh)})

    @classmethod
    def model_construct(cls, _fields_set: set[str] | None = None, **values: Any) -> Self:
        raise TypeError(
            f"{cls.__name__}.model_construct would build an unvalidated {cls.__name__}; "
            f"use {cls.__name__}.model_validate(...) (or, for a document, parse_harness or "
            "HarnessDoc.derive)"
        )

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy; with `update`, validated from scratch like a new instance (`HarnessError`)."""
        if not update:
            return super().model_copy(deep=deep)
        data = {name: getattr(self, name) for name in type(self).model_fields}
        return validate(type(self), {**data, **update}, self._copy_source())

    def copy(self, *, include: Any = None, exclude: Any = None,
             update: dict[str, Any] | None = None, deep: bool = False) -> Self:
        """Refused: pydantic's deprecated `copy` sets fields without validating them."""
        raise TypeError(
            f"{type(self).__name__}.copy is pydantic's deprecated copy, which skips "
            "validation; use model_copy(update=...) (or, for a document, derive)"
        )

    def _copy_source(self) -> str:
        return f"copy of {type(self).__name__}"


def _set_fields(state: Mapping[Any, Any], fresh: BaseModel) -> set[str]:
    """The fields an unpickled instance was given explicitly (what `exclude_unset` leaves
    out), as pickled when that is a set of its field names."""
    given = state.get("__pydantic_fields_set__")
    if isinstance(given, set) and given <= fresh.__pydantic_fields_set__:
        return set(given)
    return set(fresh.__pydantic_fields_set__)


_MAX_PROBLEMS_SHOWN = 5


def _surface_label(data: Any, index: int) -> str:
    try:
        item = data["surfaces"][index]
        # A surface given as a model (a `Surface`) has its id as an attribute.
        raw = vars(item)["id"] if isinstance(item, BaseModel) else item["id"]
    except (KeyError, IndexError, TypeError):
        return f"surfaces.{index}"
    if isinstance(raw, str) and len(raw) <= MAX_ID_CHARS and raw.isprintable() \
            and not has_lone_surrogate(raw):
        return f"surface {raw}"
    return f"surface {show(raw) if isinstance(raw, str) else index}"


def _surface_named(data: Any) -> Callable[[tuple[int | str, ...]], str]:
    """How a problem's location is named in `data`: within a surface, by the surface's id."""
    def where(location: tuple[int | str, ...]) -> str:
        if len(location) >= 2 and location[0] == "surfaces" and isinstance(location[1], int):
            label, rest = _surface_label(data, location[1]), location_name(location[2:])
            return f"{label}.{rest}" if rest else label
        return location_name(location)
    return where


def validate[M: BaseModel](model: type[M], data: Any, source: str) -> M:
    """`data` as a `model`, or one `HarnessError` naming `source` and every problem."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = validation_problem(error, where=_surface_named(data), most=_MAX_PROBLEMS_SHOWN)
        raise HarnessError(f"{source} is invalid: {problems}") from None
