"""The research API's first episodes import nothing on the trio thread (issue 15.9).

Each case runs in a fresh interpreter, where neither SDK nor its HTTP library is imported
yet: the first episode of a pool, with a real SDK against a loopback server, must leave
every import of `anthropic`, `openai`, `httpx` or `httpx2`, and every construction of the
SDK's client, to a worker thread (recorded by the import hook in `import_watch.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anthropic_server
import pytest
from first_episode import KEY_VARIABLE
from import_watch import on_threads

pytestmark = pytest.mark.slow  # a fresh interpreter each

_FIRST_EPISODE = """
import import_watch

watch = import_watch.install()
watch.arm()

import json, sys, tempfile, threading
import trio
import wmo_trio
from first_episode import serve_one_episode

DOC = {"name": "r", "surfaces": [{"id": "prompt:core", "kind": "prompt", "content": "go"}]}

server, PROVIDER = serve_one_episode(sys.argv[1])


async def main():
    with tempfile.TemporaryDirectory() as workdir:
        async with wmo_trio.open_episode_pool(limit=2) as pool:
            result = await pool.run(DOC, PROVIDER, "Say hi.", wmo_trio.DirectoryEnvironment(workdir))
    return {"stop": result.stop_reason.value, "trio": threading.current_thread().name,
            **watch.report()}


print(json.dumps(trio.run(main)))
"""


@pytest.mark.parametrize(("kind", "sdk"), [("anthropic", "anthropic"), ("openai", "openai")])
def test_the_first_episode_imports_and_builds_its_sdk_client_off_the_trio_thread(
        kind: str, sdk: str) -> None:
    here = Path(__file__).parent
    completed = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _FIRST_EPISODE, kind], capture_output=True,
        text=True, timeout=300, cwd=here,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)]),
             KEY_VARIABLE: anthropic_server.API_KEY})
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["stop"] == "submitted", report
    imported = {module for module, _ in report["imports"]}
    assert {sdk, "httpx2"} <= imported, report  # the hook saw the imports it checks
    assert report["clients"], report  # and the client's construction
    assert on_threads(report["imports"], {report["trio"]}) == [], report
    assert on_threads(report["clients"], {report["trio"]}) == [], report
