"""The harness document: one serialized agent candidate, and the views derived from it.

A document is a named, versioned set of *surfaces* (prompts, skills, the tool policy,
parameters, agent code). It is JSON-compatible with the original wmo documents: the same
JSON validates here and has the same `doc_hash`, so an optimizer can key results on it.

A document exists only validated. Its views (tools, parameters, skills, code, prompt,
`doc_hash`) are parsed once, when it is built, into immutable values; there is no way to
change its surfaces afterwards. A new candidate is derived with `derive`,
`with_surfaces` or `without_surfaces` (or `model_copy(update=...)`, which does the
same): the result is validated from scratch like any other document.

Untrusted input (a file, JSON text, a mapping) comes in through `load_harness`,
`parse_harness_json`, `parse_harness` or `harness_from`. Each refuses a bad or hostile
document with one `HarnessError` that names the source and what to change, within the
limits (`MAX_...`), before anything expensive is built. What names a document (a
`HarnessDoc`, a mapping, JSON text or a path) is decided by one rule, `document_form`.

The package's private modules, one job each: `_limits` (the limits, the error, how a
message shows a value), `_validated` (the copy and pickle guards, validation into one
error), `_surface`, `_views` and `_document` (the model), `_json` (the hostile-JSON
reader), `_files` (reading a document's file), `_naming` (the rule and the parse cache).
"""

from wmo_trio.harness._document import HarnessDoc, parse_harness
from wmo_trio.harness._files import load_harness
from wmo_trio.harness._json import parse_harness_json
from wmo_trio.harness._limits import (
    MAX_CONTENT_CHARS,
    MAX_DOCUMENT_BYTES,
    MAX_ID_CHARS,
    MAX_INTEGER,
    MAX_NAME_CHARS,
    MAX_NESTING,
    MAX_NUMBER_DIGITS,
    MAX_SURFACES,
    HarnessError,
)
from wmo_trio.harness._naming import DocumentForm, document_form, harness_from
from wmo_trio.harness._surface import (
    SLUG_PATTERN,
    Content,
    Name,
    Surface,
    SurfaceId,
    SurfaceKind,
    Text,
    blake2b16,
    code_surface_id,
)
from wmo_trio.harness._views import (
    DEFAULT_TOOLS,
    ENVIRONMENT_TOOLS,
    KNOWN_TOOLS,
    SUPPORTED_RUNTIME_KINDS,
    Params,
    Skill,
)

__all__ = [
    "DEFAULT_TOOLS",
    "ENVIRONMENT_TOOLS",
    "KNOWN_TOOLS",
    "MAX_CONTENT_CHARS",
    "MAX_DOCUMENT_BYTES",
    "MAX_ID_CHARS",
    "MAX_INTEGER",
    "MAX_NAME_CHARS",
    "MAX_NESTING",
    "MAX_NUMBER_DIGITS",
    "MAX_SURFACES",
    "SLUG_PATTERN",
    "SUPPORTED_RUNTIME_KINDS",
    "Content",
    "DocumentForm",
    "HarnessDoc",
    "HarnessError",
    "Name",
    "Params",
    "Skill",
    "Surface",
    "SurfaceId",
    "SurfaceKind",
    "Text",
    "blake2b16",
    "code_surface_id",
    "document_form",
    "harness_from",
    "load_harness",
    "parse_harness",
    "parse_harness_json",
]
