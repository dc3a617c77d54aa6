"""An episode's settings have one rule each (`wmo_trio.settings.EpisodeSettings`), whichever
way the episode is started: the harbor agent, the research API, a runtime built directly.
A bad value is one `ValueError` naming the argument as its caller spelled it, raised
before anything runs."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
from harbor_doubles import HARNESS
from pydantic import ValidationError

import wmo_trio
from wmo_trio.episode._environment import CommandResult
from wmo_trio.episode._execution import LocalExecution
from wmo_trio.harbor import WmoTrioHarborAgent
from wmo_trio.harness import parse_harness
from wmo_trio.providers import ProviderRequest, build_provider
from wmo_trio.settings import PositiveSeconds, Settings, validation_problem

DOC = {"name": "r", "surfaces": [{"id": "prompt:core", "kind": "prompt", "content": "go"}]}
OFFLINE = {"kind": "scripted", "model": "offline"}
BAD_WINDOWS = [10, 1023, -5, 0, True, 2048.0, "4096"]
BAD_TIMEOUTS = [0, -1, math.nan, math.inf, True, "300", None]


class Untouched:
    """A trio environment that fails the test if the episode ever reaches it."""

    async def exec(self, command: str) -> CommandResult:
        raise AssertionError(f"the episode ran: {command!r}")

    async def write_file(self, path: str, data: bytes) -> None:
        raise AssertionError(f"the episode ran: write {path!r}")


async def _pool_refuses(argument: str, **overrides: Any) -> str:
    async with wmo_trio.open_episode_pool(limit=1) as pool:
        with pytest.raises(ValueError, match=rf"^{argument} must be ") as raised:
            await pool.run(DOC, OFFLINE, "go", Untouched(), **overrides)
    return str(raised.value)


@pytest.mark.parametrize("value", BAD_WINDOWS)
async def test_the_research_api_refuses_a_context_window_the_agent_refuses(value: Any) -> None:
    message = await _pool_refuses("context_window", context_window=value)
    assert ">= 1024" in message


@pytest.mark.parametrize("value", BAD_TIMEOUTS)
async def test_the_research_api_refuses_a_bad_episode_timeout_by_its_own_name(value: Any) -> None:
    await _pool_refuses("episode_timeout", episode_timeout=value)


async def test_a_fan_out_spec_with_a_bad_setting_is_an_error_outcome_of_its_own() -> None:
    specs = [wmo_trio.EpisodeSpec(DOC, OFFLINE, "go", Untouched(), context_window=10)]
    async with wmo_trio.open_episode_pool(limit=1) as pool:
        async with pool.fan_out(specs) as results:
            outcomes = [outcome async for _, outcome in results]
    with pytest.raises(ValueError, match=r"^context_window must be null or an integer >= 1024, got 10$"):
        outcomes[0].unwrap()


@pytest.mark.parametrize(("research", "agent", "value"), [
    ({"context_window": 10}, {"context_window": 10}, 10),
    ({"episode_timeout": -1.0}, {"episode_timeout_sec": -1.0}, -1.0),
])
async def test_the_agent_and_the_research_api_say_the_same_of_the_same_value(
        tmp_path: Path, research: dict[str, Any], agent: dict[str, Any], value: Any) -> None:
    from_pool = await _pool_refuses(next(iter(research)), **research)
    with pytest.raises(ValueError) as raised:
        WmoTrioHarborAgent(logs_dir=tmp_path, model_name="scripted/offline", harness=HARNESS,
                           provider_config=OFFLINE, **agent)
    from_agent = str(raised.value)
    rule = from_pool.partition(" must be ")[2]
    assert rule and rule == from_agent.partition(" must be ")[2], (from_pool, from_agent)
    assert from_agent.startswith(f"{next(iter(agent))} must be ")


@pytest.mark.parametrize("value", BAD_WINDOWS)
def test_a_runtime_built_directly_refuses_a_bad_context_window(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^context_window must be null or an integer >= 1024"):
        LocalExecution(parse_harness(DOC), build_provider(OFFLINE), {"context_window": value})


def test_a_runtime_built_directly_names_the_budget_as_the_agent_does() -> None:
    with pytest.raises(ValueError, match=r"^episode_timeout_sec must be a finite positive number"):
        LocalExecution(parse_harness(DOC), build_provider(OFFLINE), {"episode_timeout_sec": 0})


@pytest.mark.parametrize("value", [0, -1, math.nan, True, "30"])
def test_a_local_process_environment_refuses_a_bad_command_timeout(tmp_path: Path, value: Any) -> None:
    with pytest.raises(ValueError, match=r"^command_timeout_sec must be a finite positive number"):
        wmo_trio.DirectoryEnvironment(tmp_path, command_timeout_sec=value)


@pytest.mark.parametrize("value", [0, 241, 1.5, True])
def test_a_harbor_environment_takes_the_agents_command_timeout_rule(value: Any) -> None:
    with pytest.raises(ValueError, match=re.escape("command_timeout_sec must be an integer in [1, 240]")):
        wmo_trio.HarborEnvironment(object(), command_timeout_sec=value)


class _Reply(Settings):
    text: str = ""
    latency_s: PositiveSeconds = 0.5


def test_a_validation_problem_names_a_hostile_key_quoted_and_cut() -> None:
    with pytest.raises(ValidationError) as error:
        ProviderRequest.model_validate({"system": "s", "messages": [{"x" * 500: 1}]})
    problem = validation_problem(error.value, whole="model request")
    assert "messages.0.role: Field required" in problem
    assert "x" * 100 not in problem and "(500 characters)" in problem


def test_a_validation_problem_shows_a_few_problems_and_counts_the_others() -> None:
    with pytest.raises(ValidationError) as error:
        ProviderRequest.model_validate({"system": "s", "messages": [1, 2, 3, 4, 5]})
    problem = validation_problem(error.value, most=2)
    assert problem.startswith("messages.0: Input should be") and "messages.1: " in problem
    more = error.value.error_count() - 2
    assert "messages.2" not in problem and problem.endswith(f"; and {more} more problems")


def test_a_validation_problem_of_settings_says_what_a_field_must_be() -> None:
    with pytest.raises(ValidationError) as error:
        _Reply.model_validate({"latency_s": -1, "txet": "typo"})
    problem = validation_problem(error.value, model=_Reply)
    assert "latency_s must be a finite positive number of seconds, got -1" in problem
    assert "unknown setting txet (did you mean text?)" in problem
