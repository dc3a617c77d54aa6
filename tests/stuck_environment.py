"""`LocalEnvironment` whose stop never returns, for `wmo-trio run -e stuck_environment:...`.

The test of a second Ctrl-C needs the job's cleanup to be under way and unfinished when
that signal comes: this environment stops its trial as LocalEnvironment does (no process
of it is left), then says so by creating the file `$WMO_TEST_STOPPED` and waits forever.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from wmo_trio.harbor import LocalEnvironment


class StopNeverReturns(LocalEnvironment):  # type: ignore[misc]
    async def stop(self, delete: bool) -> None:
        await super().stop(delete)
        Path(os.environ["WMO_TEST_STOPPED"]).touch()
        await asyncio.Event().wait()
