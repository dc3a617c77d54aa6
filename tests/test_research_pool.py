"""The episode pool's providers: built and prepared once per configuration, in a worker
thread, before their first episode; closed with the pool when the pool built them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar, Self

import pytest

import wmo_trio
import wmo_trio.providers
from wmo_trio import DirectoryEnvironment, EpisodeSpec
from wmo_trio.models import StopReason
from wmo_trio.providers import CallControl, ProviderConfig, ProviderRequest, ProviderResponse, build_provider
from wmo_trio.providers._scripted import ScriptedProvider

DOC = {"name": "r", "surfaces": [{"id": "prompt:core", "kind": "prompt", "content": "go"}]}
HELLO = "Create the file `out/hi.txt` whose whole content is the line `hi`"
COUNTED = {"kind": "counted", "model": "offline"}


class CountedProvider(ScriptedProvider):
    """The scripted provider (its offline policy), saying on which thread it was built,
    prepared, called and closed."""

    events: ClassVar[list[tuple[str, str]]] = []

    @classmethod
    def _note(cls, event: str) -> None:
        cls.events.append((event, threading.current_thread().name))

    @classmethod
    def from_config(cls, config: ProviderConfig) -> Self:
        cls._note("built")
        return super().from_config(config)

    def prepare(self) -> None:
        self._note("prepared")

    def complete(self, request: ProviderRequest, control: CallControl) -> ProviderResponse:
        self._note("called")
        return super().complete(request, control)

    def close(self) -> None:
        self._note("closed")


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[CountedProvider]]:
    monkeypatch.setattr(CountedProvider, "events", [])
    monkeypatch.setitem(wmo_trio.providers._REGISTRY, "counted", f"{__name__}:CountedProvider")
    yield CountedProvider


def _specs(tmp_path: Path, provider: object, count: int) -> list[EpisodeSpec]:
    specs = []
    for index in range(count):
        (tmp_path / str(index)).mkdir(parents=True)
        specs.append(EpisodeSpec(DOC, provider, HELLO,  # type: ignore[arg-type]
                                 DirectoryEnvironment(tmp_path / str(index)), task_id=str(index)))
    return specs


async def _fan_out(specs: list[EpisodeSpec], limit: int) -> list[StopReason]:
    reasons = []
    async with wmo_trio.open_episode_pool(limit=limit) as pool:
        async with pool.fan_out(specs) as results:
            async for _, outcome in results:
                reasons.append(outcome.unwrap().stop_reason)
    return reasons


async def test_episodes_that_start_together_share_one_provider_built_and_prepared_off_the_trio_thread(
        tmp_path: Path, counted: type[CountedProvider]) -> None:
    reasons = await _fan_out(_specs(tmp_path, COUNTED, 8), limit=8)
    assert reasons == [StopReason.SUBMITTED] * 8
    events = [event for event, _ in counted.events]
    # one build, prepared before any episode calls it, closed once with the pool
    assert events[:2] == ["built", "prepared"] and events[-1] == "closed", events
    assert events.count("built") == events.count("prepared") == events.count("closed") == 1, events
    trio_thread = threading.current_thread().name
    assert all(thread != trio_thread for event, thread in counted.events if event != "closed"), counted.events


async def test_each_configuration_of_a_pool_gets_its_own_provider(
        tmp_path: Path, counted: type[CountedProvider]) -> None:
    specs = [*_specs(tmp_path / "a", COUNTED, 2), *_specs(tmp_path / "b", {**COUNTED, "latency_s": 0.001}, 2)]
    await _fan_out(specs, limit=4)
    events = [event for event, _ in counted.events]
    assert events.count("built") == events.count("prepared") == events.count("closed") == 2, events


async def test_a_callers_own_provider_is_prepared_once_and_left_open(
        tmp_path: Path, counted: type[CountedProvider]) -> None:
    provider = build_provider(COUNTED, with_retries=False)
    counted.events.clear()
    await _fan_out(_specs(tmp_path, provider, 4), limit=4)
    events = [event for event, _ in counted.events]
    assert events[0] == "prepared" and events.count("prepared") == 1, events
    assert "closed" not in events and "built" not in events, events


async def test_a_provider_that_cannot_prepare_fails_its_episodes_before_they_run(
        tmp_path: Path, counted: type[CountedProvider], monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: CountedProvider) -> None:
        raise ImportError("no SDK here")

    monkeypatch.setattr(CountedProvider, "prepare", refuse)
    async with wmo_trio.open_episode_pool(limit=2) as pool:
        with pytest.raises(ImportError, match="no SDK here"):
            await pool.run(DOC, COUNTED, HELLO, DirectoryEnvironment(tmp_path))
    events = [event for event, _ in counted.events]
    assert events == ["built", "closed"], events  # never called; the half-made one closed
