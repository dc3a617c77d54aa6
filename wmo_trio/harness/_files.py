"""Reading a document's file: only a regular file, never waiting on a FIFO or device, at
most `MAX_DOCUMENT_BYTES`."""

from __future__ import annotations

import os
from pathlib import Path

from wmo_trio._files import NotARegularFile, TooLarge, read_bounded
from wmo_trio.harness._document import HarnessDoc
from wmo_trio.harness._json import parse_harness_json
from wmo_trio.harness._limits import MAX_DOCUMENT_BYTES, HarnessError, show_path


def _read_regular_file(file: Path) -> bytes:
    try:
        return read_bounded(file, MAX_DOCUMENT_BYTES, follow=True)
    except NotARegularFile as error:
        raise HarnessError(f"cannot read harness document {show_path(file)}: {error}; give "
                           "the path of a JSON file") from None
    except TooLarge as error:
        raise HarnessError(f"{show_path(file)} is {error.size:,} bytes, over the limit of "
                           f"{MAX_DOCUMENT_BYTES:,} bytes for a harness document") from None
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise Unreadable(f"cannot read harness document {show_path(file)}: {reason}") from None
    except ValueError as error:  # a NUL in the path, or a path that cannot be encoded
        raise Unreadable(f"cannot read harness document {show_path(file)}: {error}") from None


class Unreadable(HarnessError):
    """No file could be opened at the path (missing, not permitted, not a path at all)."""


def load_harness(path: str | os.PathLike[str]) -> HarnessDoc:
    """Read and validate a document from a JSON file; errors name the file and the surface.

    Only regular files are read (a FIFO, directory or device is refused without waiting on
    it), at most `MAX_DOCUMENT_BYTES` of them. Raises `HarnessError`.
    """
    file = Path(path)
    return parse_harness_json(_read_regular_file(file), source=show_path(file))
