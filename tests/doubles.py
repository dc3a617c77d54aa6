"""Test doubles shared by the episode, code-runtime, E2B, retry and provider tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from wmo_trio.harness import HarnessDoc, parse_harness
from wmo_trio.models import Step
from wmo_trio.providers import CallControl, ProviderConfig, ProviderRequest, ProviderResponse
from wmo_trio.providers._scripted import ScriptedProvider, load_script


def make_doc(**params: Any) -> HarnessDoc:
    """A one-prompt document; `policy=` sets tool_policy:main, `skill=` adds skill:notes,
    and any other keyword sets the parameter of that name (`max_turns=3`)."""
    surfaces: list[dict[str, Any]] = [{"id": "prompt:core", "kind": "prompt", "content": "work"}]
    for name, value in params.items():
        if name == "policy":
            surfaces.append({"id": "tool_policy:main", "kind": "tool_policy", "content": value})
        elif name == "skill":
            surfaces.append({"id": "skill:notes", "kind": "skill",
                             "content": f"---\nname: notes\ndescription: d\n---\n{value}"})
        else:
            surfaces.append({"id": f"param:{name.replace('_', '-')}", "kind": "param",
                             "content": str(value)})
    return parse_harness({"name": "t", "surfaces": surfaces})


def when(event: threading.Event, then: Callable[[], None]) -> None:
    """In a thread of its own: `then()` once `event` is set (an abort once a call is in
    flight, say)."""
    def wait() -> None:
        event.wait()
        then()

    threading.Thread(target=wait, daemon=True).start()


class Spy:
    """A scripted provider that keeps every request it was sent; `calling` is set as its
    first call begins (before the reply's latency)."""

    def __init__(self, script: list[dict[str, Any]], latency_s: float = 0.0) -> None:
        self.inner = ScriptedProvider(ProviderConfig(kind="scripted", model="s"),
                                      script=load_script(script), latency_s=latency_s)
        self.config = self.inner.config
        self.requests: list[ProviderRequest] = []
        self.calling = threading.Event()

    def complete(self, request: ProviderRequest, control: CallControl) -> ProviderResponse:
        self.requests.append(request)
        self.calling.set()
        return self.inner.complete(request, control)

    def close(self) -> None:
        pass


class RecordingControl(CallControl):
    """A CallControl that remembers every wait it was asked for; `sleeping` is set as the
    first one begins."""

    def __init__(self, deadline: float | None = None) -> None:
        super().__init__(deadline)
        self.sleeps: list[float] = []
        self.sleeping = threading.Event()

    def sleep(self, seconds: float) -> bool:
        self.sleeps.append(seconds)
        self.sleeping.set()
        return super().sleep(seconds)


def untimed(steps: list[Step]) -> list[Step]:
    """`steps` without when they ran, to compare what two runs did."""
    return [step.model_copy(update={"started_at": None, "duration_s": None}) for step in steps]
