"""The harness document: one candidate, validated whole, immutable, hashable; and
`parse_harness`, the way JSON-like data becomes one."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Annotated, Any, Self

from pydantic import Field, PrivateAttr, field_validator, model_validator

from wmo_trio._text import show
from wmo_trio.harness._limits import MAX_INTEGER, MAX_SURFACES, HarnessError
from wmo_trio.harness._surface import Name, Surface, valid_keys
from wmo_trio.harness._validated import Validated, validate
from wmo_trio.harness._views import Params, Skill, Views, views_of


class HarnessDoc(Validated):
    """A harness document: one candidate, validated whole, immutable, hashable.

    Surfaces are kept as a tuple sorted by id (a list in JSON), so input order never
    matters. Two documents are equal when their data (name, version, surfaces) is equal;
    equal documents hash equal. `doc_hash` is the candidate's identity: name, version,
    budgets and surface order do not enter it.

    Derive a candidate with `derive(name=..., version=..., surfaces=...)`,
    `with_surfaces(...)` or `without_surfaces(...)`; each validates the result from
    scratch and raises `HarnessError` when it is not a valid document.
    `model_copy(update=...)` does the same, and so does loading a pickle (it is validated
    again from its fields); `model_construct` is refused.
    """

    name: Name
    version: Annotated[int, Field(ge=0, le=MAX_INTEGER)] = 0
    surfaces: tuple[Surface, ...]

    _views: Views = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _keys_are_text(cls, data: Any) -> Any:
        return valid_keys(data)

    @field_validator("surfaces", mode="before")
    @classmethod
    def _not_too_many(cls, value: Any) -> Any:
        # Counted before any surface is validated, so a huge document costs nothing.
        if isinstance(value, Iterator):
            value = list(itertools.islice(value, MAX_SURFACES + 1))
            if len(value) > MAX_SURFACES:
                raise ValueError(f"more than {MAX_SURFACES:,} surfaces, the limit per document")
        if isinstance(value, Sized) and not isinstance(value, str | bytes | Mapping):
            if len(value) > MAX_SURFACES:
                raise ValueError(f"{len(value):,} surfaces, over the limit of {MAX_SURFACES:,} "
                                 "per document")
        return value

    @field_validator("surfaces")
    @classmethod
    def _sorted_and_unique(cls, surfaces: tuple[Surface, ...]) -> tuple[Surface, ...]:
        ordered = tuple(sorted(surfaces, key=lambda surface: surface.id))
        for before, after in itertools.pairwise(ordered):
            if before.id == after.id:
                raise ValueError(f"surface id {before.id!r} appears more than once")
        return ordered

    @model_validator(mode="after")
    def _parse_views(self) -> Self:
        self._views = views_of(self.surfaces)
        return self

    # -- deriving candidates ------------------------------------------------------------------

    def derive(self, *, name: str | None = None, version: int | None = None,
               surfaces: Iterable[Surface | Mapping[str, Any]] | None = None) -> Self:
        """A new document with the given fields replaced (`surfaces` replaces all of them),
        validated from scratch; with no change, this document.

        Raises `HarnessError` when the result is not a valid document.
        """
        update: dict[str, Any] = {}
        if name is not None:
            update["name"] = name
        if version is not None:
            update["version"] = version
        if surfaces is not None:
            update["surfaces"] = tuple(surfaces)
        return self.model_copy(update=update) if update else self

    def with_surfaces(self, *surfaces: Surface | Mapping[str, Any]) -> Self:
        """This candidate with `surfaces` put in: each replaces the surface with its id, or joins.

        Raises `HarnessError` when an id is given twice or the result is not a valid document.
        """
        merged: dict[object, Surface | Mapping[str, Any]] = {s.id: s for s in self.surfaces}
        given: set[object] = set()
        for surface in surfaces:
            key: object = surface.id if isinstance(surface, Surface) else surface.get("id")
            if not isinstance(key, str):
                key = object()  # no usable id: it joins, and validation says what is wrong
            elif key in given:
                raise HarnessError(f"{self._copy_source()}: surface {show(key)} is given twice")
            given.add(key)
            merged[key] = surface
        return self.derive(surfaces=merged.values())

    def without_surfaces(self, *surface_ids: str) -> Self:
        """This candidate without the surfaces with these ids (each must exist).

        Raises `HarnessError` when an id is not in the document or the result is not valid.
        """
        missing = [surface_id for surface_id in surface_ids if self.surface(surface_id) is None]
        if missing:
            raise HarnessError(f"{self._copy_source()}: no surface {show(missing[0])} to remove")
        dropped = set(surface_ids)
        return self.derive(surfaces=[s for s in self.surfaces if s.id not in dropped])

    def _copy_source(self) -> str:
        return f"candidate derived from {show(self.name)}"

    # -- lookup ----------------------------------------------------------------------------------

    def surface(self, surface_id: str) -> Surface | None:
        index = bisect.bisect_left(self._views.ids, surface_id)
        if index < len(self.surfaces) and self._views.ids[index] == surface_id:
            return self.surfaces[index]
        return None

    # -- derived views -----------------------------------------------------------------------

    @property
    def doc_hash(self) -> str:
        """The candidate's identity (CONTRACT section 2): BLAKE2b over the surfaces in id order."""
        return self._views.doc_hash

    @property
    def system_prompt(self) -> str:
        """The prompt surfaces' contents in id order, joined by a blank line."""
        return self._views.system_prompt

    @property
    def skills(self) -> tuple[Skill, ...]:
        return self._views.skills

    @property
    def tools(self) -> tuple[str, ...]:
        """The tools the agent may call, in policy order; `read_skill` joins when skills exist."""
        return self._views.tools

    @property
    def params(self) -> Params:
        return self._views.params

    @property
    def runtime_kind(self) -> str:
        return self._views.runtime_kind

    @property
    def runtime_code(self) -> str | None:
        """The source of `code:runtime` (checked to compile and define `run`), if any."""
        return self._views.runtime_code

    @property
    def unknown_params(self) -> tuple[str, ...]:
        """Parameter surfaces this implementation does not read (kept, and hashed)."""
        return self._views.unknown_params


def parse_harness(data: Any, *, source: str = "harness document") -> HarnessDoc:
    """Validate JSON-like data (a mapping, as `json.loads` gives it) as a document.

    Raises `HarnessError` naming `source` when it is not a valid document.
    """
    return validate(HarnessDoc, data, source)


