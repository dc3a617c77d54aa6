"""`WmoTrioHarborAgent`: one harness candidate, run as a harbor agent on the trio engine.

Harbor owns the task environment and the verifier; this agent runs the episode host-side.
Every keyword argument is checked in the constructor, so a bad candidate or configuration
fails before harbor starts a single container.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import outcome
from harbor.agents.base import BaseAgent
from harbor.agents.capabilities import AgentCapabilities
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext

from wmo_trio import __version__
from wmo_trio.engine import DEFAULT_EPISODE_WORKERS, HostCaller, host_for_running_loop
from wmo_trio.episode.build import Runtime, build_runtime, check_backend
from wmo_trio.episode.environment import MAX_COMMAND_TIMEOUT_SEC, check_command_timeout
from wmo_trio.episode.runtime import DEFAULT_EPISODE_TIMEOUT_S, EpisodeLog, check_episode_timeout
from wmo_trio.episode.tools import tool_spec
from wmo_trio.harbor._adapter import HarborEnvironmentAdapter
from wmo_trio.harness import HarnessDoc, HarnessError, harness_from
from wmo_trio.models import RunResult
from wmo_trio.providers import Provider, ProviderConfigError, build_provider, parse_provider_config
from wmo_trio.trace import TraceWriter, TrajectoryInfo, trace_for

log = logging.getLogger("wmo_trio.harbor")

AGENT_NAME = "wmo-harness"


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_context_window(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1024:
        raise ValueError(f"context_window must be null or an integer >= 1024, got {value!r}")
    return value


class WmoTrioHarborAgent(BaseAgent):  # type: ignore[misc]  # harbor ships no type information
    """Runs a serialized harness candidate while harbor owns the task and the verifier.

    Use it with `harbor run -a wmo_trio.harbor:WmoTrioHarborAgent -m <kind>/<model>
    --ak harness=<doc or path> --ak provider_config=<json>`. The trace `wmo-run.json` and an
    ATIF `trajectory.json` are written to `logs_dir` for every trial, timeouts included.
    """

    capabilities: ClassVar[AgentCapabilities] = AgentCapabilities(atif=True)

    def __init__(self, logs_dir: Path, model_name: str | None = None, *, harness: Any = None,
                 provider_config: Any = None, harness_backend: str = "local",
                 e2b_template: str | None = None,
                 command_timeout_sec: int = MAX_COMMAND_TIMEOUT_SEC,
                 episode_timeout_sec: float = DEFAULT_EPISODE_TIMEOUT_S,
                 episode_workers: int = DEFAULT_EPISODE_WORKERS,
                 context_window: int | None = None, extra_env: dict[str, str] | None = None,
                 **harbor_kwargs: Any) -> None:
        """Check every argument (a `ValueError` naming it) before harbor starts anything.

        harbor's own arguments (`logger`, `mcp_servers`, `skills_dir`, and whatever later
        releases add) go on to `BaseAgent` untouched.
        """
        if extra_env:
            raise ValueError(
                "extra_env is not supported: wmo_trio does not inject agent environment "
                f"variables (got {sorted(extra_env)}); remove them from the agent config"
            )
        if harness is None:
            raise ValueError("harness is required: pass a harness document or a path to one")
        if provider_config is None:
            raise ValueError("provider_config is required: pass a JSON object with kind and model")
        try:
            doc = harness_from(harness)
        except HarnessError as error:
            raise ValueError(f"harness: {error}") from None
        if not isinstance(provider_config, dict):
            raise ValueError(
                f"provider_config must be a JSON object, got {type(provider_config).__name__}"
            )
        try:
            config = parse_provider_config(provider_config)
        except ProviderConfigError as error:
            raise ValueError(f"provider_config: {error}") from None
        if model_name != config.model_name:
            raise ValueError(
                f"model_name must be {config.model_name!r} (provider_config kind/model), "
                f"got {model_name!r}"
            )
        check_backend(harness_backend, e2b_template)
        self._command_timeout_sec = check_command_timeout(command_timeout_sec)
        self._episode_timeout_sec = check_episode_timeout(episode_timeout_sec)
        self._episode_workers = _check_positive_int("episode_workers", episode_workers)
        self._context_window = _check_context_window(context_window)
        try:
            provider = build_provider(config)
        except ProviderConfigError as error:
            raise ValueError(f"provider_config: {error}") from None
        super().__init__(logs_dir, model_name, **harbor_kwargs)
        self._doc = doc
        self._provider: Provider = provider
        self._harness_backend = harness_backend
        self._e2b_template = e2b_template
        if doc.runtime_code is not None and harness_backend == "local":
            self.logger.warning(
                "harness %s: code:runtime runs in this process with the host's rights "
                "(trusted code only); use harness_backend='e2b' for mutated candidates",
                doc.name,
            )

    @staticmethod
    def name() -> str:
        return AGENT_NAME

    def version(self) -> str:
        return __version__

    @property
    def doc(self) -> HarnessDoc:
        return self._doc

    async def setup(self, environment: BaseEnvironment) -> None:
        """Nothing to install: the episode runs host-side. Start the engine's worker
        threads now, so trials that start together do not each create one in `run()`."""
        try:
            await host_for_running_loop().prepare(self._episode_workers)
        except Exception:
            log.warning("starting worker threads ahead of time failed; each episode will "
                        "start its own", exc_info=True)

    async def run(self, instruction: str, environment: BaseEnvironment,
                  context: AgentContext) -> None:
        """Run the episode on the trio engine; see `HarborEpisode` for what happens when
        harbor cancels it."""
        context.metadata = {**(context.metadata or {}), "candidate_doc_hash": self._doc.doc_hash}
        episode = self._new_episode(instruction, environment, context)
        result = await self._run_episode(episode)
        context.metadata = {
            **(context.metadata or {}),
            "stop_reason": result.stop_reason.value,
            "turns": result.turns,
        }

    def _new_episode(self, instruction: str, environment: BaseEnvironment,
                     context: AgentContext) -> HarborEpisode:
        return HarborEpisode(self, instruction, environment, context)

    async def _run_episode(self, episode: HarborEpisode) -> RunResult:
        try:
            host = host_for_running_loop()
        except Exception as error:
            # Nothing ran, but the trial still gets its trace, as every trial does.
            episode.record(outcome.Error(error), cancelled=False)
            raise
        return await host.run_episode(episode, workers=self._episode_workers)

    def _trajectory_info(self, runtime: Runtime | None, instruction: str) -> TrajectoryInfo:
        return TrajectoryInfo(
            agent_name=AGENT_NAME,
            agent_version=__version__,
            model_name=self.model_name,
            session_id=self.session_id,
            system_prompt=runtime.system_prompt() if runtime else self._doc.system_prompt,
            instruction=instruction,
            tools=[tool_spec(name).model_dump() for name in self._doc.tools],
            extra={"candidate_doc_hash": self._doc.doc_hash, "harness": self._doc.name},
        )


class HarborEpisode:
    """One trial's episode, as the engine drives it (see `wmo_trio.engine.Episode`).

    When harbor cancels the agent: `stop()` makes `should_cancel` true and aborts the
    runtime (which cancels the environment command in flight); the engine waits for the
    worker, then `close()` and `record()` run shielded, then the cancellation propagates.
    """

    def __init__(self, agent: WmoTrioHarborAgent, instruction: str,
                 environment: BaseEnvironment, context: AgentContext, *,
                 caller_factory: Callable[[], Any] = HostCaller) -> None:
        self._agent = agent
        self._caller_factory = caller_factory
        self._instruction = instruction
        self._environment = environment
        self._context = context
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._runtime: Runtime | None = None
        self._log: EpisodeLog | None = None
        self.task_id = str(agent.context_id or agent.session_id or "harbor-task")
        # Aborting a local runtime only sets flags; aborting an E2B one kills its sandbox
        # over the network, so the engine gives that stop a thread of its own.
        self.stop_is_quick = agent._harness_backend == "local"

    def run(self) -> RunResult:
        agent = self._agent
        # A task environment is mutable: an e2b transport failure is never replayed
        # against one an earlier attempt may have changed.
        runtime = build_runtime(
            agent.doc,
            agent._provider,
            backend=agent._harness_backend,
            e2b_template=agent._e2b_template,
            episode_timeout_s=agent._episode_timeout_sec,
            should_cancel=self._cancel.is_set,
            context_window=agent._context_window,
            on_progress=self._report_usage,
            transport_retries=0,
        )
        with self._lock:
            self._runtime, self._log = runtime, runtime.log
        adapter = HarborEnvironmentAdapter(
            self._environment, self._caller_factory(), command_timeout_sec=agent._command_timeout_sec
        )
        return runtime.run(self.task_id, self._instruction, adapter)

    def _report_usage(self, log: EpisodeLog) -> None:
        # Written from the worker thread while harbor waits, so a trial that times out
        # still reports the tokens it spent. Plain attribute stores; harbor only reads
        # the context after run() returns or is cancelled.
        usage = log.usage()
        self._context.n_input_tokens = usage.input_tokens
        self._context.n_cache_tokens = usage.cached_input_tokens
        self._context.n_output_tokens = usage.output_tokens

    def stop(self) -> None:
        self._cancel.set()
        with self._lock:
            runtime = self._runtime
        if runtime is not None:
            runtime.abort()

    def close(self) -> None:
        with self._lock:
            runtime = self._runtime
        if runtime is not None:
            runtime.close()
        self._agent._provider.close()

    def record(self, result: outcome.Outcome[RunResult], cancelled: bool) -> None:
        trace = trace_for(self.task_id, result, cancelled=cancelled, log=self._log)
        self._context.metadata = {
            **(self._context.metadata or {}),
            "stop_reason": str(trace.stop_reason),
            "turns": trace.turns,
        }
        TraceWriter(self._agent.logs_dir).write(
            trace,
            trajectory=self._agent._trajectory_info(self._runtime, self._instruction),
            log=self._log,
        )

