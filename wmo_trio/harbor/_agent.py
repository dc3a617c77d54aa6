"""`WmoTrioHarborAgent`: one harness candidate, run as a harbor agent on the trio engine.

Harbor owns the task environment and the verifier; this agent runs the episode host-side.
Every keyword argument is checked in the constructor, so a bad candidate or configuration
fails before harbor starts a single container. The constructor does no I/O beyond reading
a document file once per process (harbor builds it on its event loop): the provider's SDK
is imported, and its client built, in a worker thread on the first model call.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar

import outcome
from harbor.agents.base import BaseAgent
from harbor.agents.capabilities import AgentCapabilities
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext
from pydantic import AfterValidator, BeforeValidator, Field

from wmo_trio import __version__
from wmo_trio.backends import BackendChoice, build_runtime, check_e2b_key, check_sandbox, resolve_backend
from wmo_trio.control import CallControl
from wmo_trio.engine import DEFAULT_EPISODE_WORKERS, host_for_running_loop, settle_heap
from wmo_trio.episode.environment import Environment
from wmo_trio.episode.log import EpisodeLog
from wmo_trio.episode.runtime import Runtime, RuntimeEpisode
from wmo_trio.episode.services import system_prompt
from wmo_trio.episode.tools import tool_spec
from wmo_trio.harbor._adapter import HarborEnvironmentAdapter
from wmo_trio.harbor._trajectory import TrajectoryInfo, write_trajectory
from wmo_trio.harness import HarnessDoc, HarnessError, harness_from
from wmo_trio.models import RunResult
from wmo_trio.providers import (
    Provider,
    ProviderConfig,
    ProviderConfigError,
    build_provider,
    parse_provider_config,
)
from wmo_trio.settings import (
    DEFAULT_EPISODE_TIMEOUT_S,
    MAX_COMMAND_TIMEOUT_SEC,
    CommandTimeout,
    EpisodeSettings,
    PositiveInt,
    not_given,
    refused,
)
from wmo_trio.trace import (
    CANCELLED_BY_HARBOR,
    CANCELLED_BY_HARBOR_TIMEOUT,
    trace_for,
    write_trace,
)

log = logging.getLogger("wmo_trio.harbor")

AGENT_NAME = "wmo-harness"
_DEADLINE_SLACK_S = 0.05


def _document(value: object) -> HarnessDoc:
    if value is None:
        raise not_given()
    try:
        return harness_from(value)
    except HarnessError as error:
        raise refused(str(error)) from None


def _provider_config(value: object) -> ProviderConfig:
    if value is None:
        raise not_given()
    if not isinstance(value, dict):
        raise refused(f"must be a JSON object with kind and model, got {type(value).__name__}")
    try:
        return parse_provider_config(value)
    except ProviderConfigError as error:
        raise refused(str(error)) from None


def _no_extra_env(value: dict[str, str] | None) -> dict[str, str] | None:
    if value:
        raise refused("not supported: wmo_trio does not inject agent environment variables "
                      f"(got {sorted(value)}); remove them from the agent config")
    return value


class AgentArguments(EpisodeSettings, BackendChoice):
    """The agent's keyword arguments (README: "the agent's keyword arguments"), checked:
    the document parsed (`harness_from`) and the provider configuration read
    (`parse_provider_config`). Building the provider, and the checks that depend on this
    process (the model name harbor passes, an E2B key), are the agent's own."""

    harness: Annotated[HarnessDoc, BeforeValidator(_document)] = Field(
        description="a harness document (a JSON object, JSON text or the path of a JSON file)")
    provider_config: Annotated[ProviderConfig, BeforeValidator(_provider_config)] = Field(
        description="a JSON object with kind and model")
    command_timeout_sec: CommandTimeout = MAX_COMMAND_TIMEOUT_SEC
    episode_workers: PositiveInt = DEFAULT_EPISODE_WORKERS
    extra_env: Annotated[dict[str, str] | None, AfterValidator(_no_extra_env)] = None


def _checked_arguments(model_name: str | None, arguments: Mapping[str, object], *,
                       check_model_name: bool = True) -> tuple[AgentArguments, Provider]:
    """Every keyword argument checked, each failure a `ValueError` naming it; the
    arguments (the backend chosen when none was named) and the provider for the agent's
    trial."""
    checked: AgentArguments = AgentArguments.parse(arguments)
    if checked.harness_backend is None:
        checked = checked.model_copy(update={
            "harness_backend": resolve_backend(checked.harness, checked.harness_backend)})
    config = checked.provider_config
    if check_model_name and model_name != config.model_name:
        raise ValueError(
            f"model_name must be {config.model_name!r} (provider_config kind/model), "
            f"got {model_name!r}"
        )
    if checked.harness_backend == "e2b":
        check_e2b_key()
    elif checked.harness_backend == "sandbox":
        check_sandbox()
    try:
        provider = build_provider(config)
    except ProviderConfigError as error:
        raise ValueError(f"provider_config: {error}") from None
    return checked, provider


class WmoTrioHarborAgent(BaseAgent):  # type: ignore[misc]  # harbor ships no type information
    """Runs a serialized harness candidate while harbor owns the task and the verifier.

    Use it with `harbor run -a wmo_trio.harbor:WmoTrioHarborAgent -m <kind>/<model>
    --ak harness=<doc or path> --ak provider_config=<json>`. The trace `wmo-run.json` and an
    ATIF `trajectory.json` are written to `logs_dir` for every trial, timeouts included.
    """

    capabilities: ClassVar[AgentCapabilities] = AgentCapabilities(atif=True)

    def __init__(self, logs_dir: Path, model_name: str | None = None, *, harness: Any = None,
                 provider_config: Any = None, harness_backend: str | None = None,
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
        arguments, provider = _checked_arguments(model_name, {
            "harness": harness, "provider_config": provider_config,
            "harness_backend": harness_backend, "e2b_template": e2b_template,
            "command_timeout_sec": command_timeout_sec, "episode_timeout_sec": episode_timeout_sec,
            "episode_workers": episode_workers, "context_window": context_window,
            "extra_env": extra_env})
        super().__init__(logs_dir, model_name, **harbor_kwargs)
        self._arguments = arguments
        self._provider = provider
        # Before the burst of agents a harbor job constructs: each construction otherwise
        # ran the collector's full passes over every agent made so far.
        settle_heap()
        if arguments.harness.runtime_code is not None and arguments.harness_backend == "local":
            self.logger.warning(
                "harness %s: code:runtime runs in this process with the host's rights "
                "(trusted code only); use harness_backend='sandbox' (Linux with bubblewrap) "
                "or 'e2b' for mutated candidates",
                arguments.harness.name,
            )

    @classmethod
    def preflight(cls, kwargs: dict[str, Any] | None = None,
                  env: Mapping[str, str] | None = None) -> None:
        """Harbor calls this once per job, before any trial: every argument is checked
        here already, and the files trials need (the document, a provider's script) are
        read now, so no trial reads them on harbor's loop."""
        super().preflight(kwargs, env)
        arguments = {name: value for name, value in (kwargs or {}).items()
                     if name in AgentArguments.model_fields}
        _checked_arguments(None, arguments, check_model_name=False)

    @staticmethod
    def name() -> str:
        return AGENT_NAME

    def _parse_model_name(self, model_name: str) -> tuple[str | None, str]:
        """harbor's hook for an agent's model-name policy: ours is `<kind>/<model>` of a
        wmo_trio provider (checked against `provider_config` already), not a litellm model.
        harbor's default looks every name up in litellm's tables, a cost paid per trial."""
        kind, _, model = model_name.partition("/")
        return kind or None, model

    def version(self) -> str:
        return __version__

    @property
    def doc(self) -> HarnessDoc:
        return self._arguments.harness

    @property
    def provider(self) -> Provider:
        """The provider built for this agent's trial; its episode closes it."""
        return self._provider

    async def setup(self, environment: BaseEnvironment) -> None:
        """Nothing to install: the episode runs host-side. Before the burst of trials, in
        worker threads: import what the provider's calls need, settle the heap, and start
        the engine's worker threads, so trials that start together find them ready."""
        try:
            await host_for_running_loop().prepare(self._arguments.episode_workers,
                                                  load=self._provider.prepare)
        except Exception:
            log.warning("preparing for the trials failed; each episode will do what it "
                        "needs itself", exc_info=True)

    async def run(self, instruction: str, environment: BaseEnvironment,
                  context: AgentContext) -> None:
        """Run the episode on the trio engine; see `HarborEpisode` for what happens when
        harbor cancels it."""
        context.metadata = {**(context.metadata or {}), "candidate_doc_hash": self.doc.doc_hash}
        # Harbor builds an agent per trial and runs it once: its episode takes over the
        # provider and closes it in its cleanup.
        episode = HarborEpisode(
            self._arguments, self.model_name, self._provider, instruction, environment, context,
            logs_dir=Path(self.logs_dir),
            task_id=str(self.context_id or self.session_id or "harbor-task"),
            session_id=self.session_id, timed_out=_harbor_timeout(),
        )
        # The episode's record() sets the context's stop_reason and turns, however it ends.
        await self._run_episode(episode)

    async def _run_episode(self, episode: HarborEpisode) -> RunResult:
        try:
            host = host_for_running_loop()
        except Exception as error:
            # Nothing ran, but the trial still gets its trace, as every trial does.
            episode.record(outcome.Error(error), cancelled=False)
            raise
        return await host.run_episode(episode, workers=self._arguments.episode_workers)


def _harbor_timeout() -> Callable[[], bool] | None:
    """A way to tell, when the episode is cancelled, whether harbor's agent timeout did it;
    None when harbor set no timeout.

    Harbor awaits `run()` inside `asyncio.wait_for(run(...), timeout)`, in the same task, so
    the frames just above this coroutine's hold its timeout: an `asyncio.Timeout` bound to
    a name (asked whether it `expired()`), or `wait_for`'s `timeout` argument (a deadline
    on the monotonic clock, less a little slack for harbor's own earlier clock reading).
    """
    frame = sys._getframe(2)  # the frame that awaits run()
    for _ in range(8):
        if frame is None:
            return None
        for value in frame.f_locals.values():
            if isinstance(value, asyncio.Timeout):
                return value.expired
        if frame.f_code is asyncio.wait_for.__code__:
            timeout = frame.f_locals.get("timeout")
            if isinstance(timeout, int | float) and not isinstance(timeout, bool):
                deadline = time.monotonic() + timeout - _DEADLINE_SLACK_S
                return lambda: time.monotonic() >= deadline
            return None
        frame = frame.f_back  # type: ignore[assignment]
    return None


class HarborEpisode(RuntimeEpisode):
    """One trial's episode, as the engine drives it (see `wmo_trio.engine.Episode`). It owns
    `provider`, which it closes in its cleanup.

    When harbor cancels the agent: `stop()` makes `should_cancel` true and aborts the
    runtime (the engine then cancels the environment command in flight); the engine waits
    for the worker, then `close()` and `record()` run shielded, then the cancellation
    propagates. The partial trace says whether harbor's agent timeout or something else
    (an interrupted `harbor run`) cancelled it.
    """

    def __init__(self, arguments: AgentArguments, model_name: str | None, provider: Provider,
                 instruction: str, environment: BaseEnvironment, context: AgentContext, *,
                 logs_dir: Path, task_id: str, session_id: str | None,
                 timed_out: Callable[[], bool] | None) -> None:
        super().__init__(task_id, instruction)
        self._arguments = arguments
        self._model_name = model_name
        self._provider = provider
        self._environment = environment
        self._context = context
        self._logs_dir = logs_dir
        self._session_id = session_id
        self._timed_out = timed_out
        # Aborting a local runtime only sets flags, a sandboxed one sends a signal; aborting
        # an E2B one kills its sandbox over the network, so the engine gives that stop a
        # thread of its own.
        self.stop_is_quick = arguments.harness_backend != "e2b"
        self._cancel_reason: str | None = None

    def start(self, control: CallControl,
              should_cancel: Callable[[], bool]) -> tuple[Runtime, Environment]:
        arguments = self._arguments
        # A task environment is mutable: an e2b transport failure is never replayed
        # against one an earlier attempt may have changed.
        runtime = build_runtime(
            arguments.harness, self._provider, control=control, backend=arguments.harness_backend,
            e2b_template=arguments.e2b_template,
            episode_timeout_s=arguments.episode_timeout_sec,
            should_cancel=should_cancel, context_window=arguments.context_window,
            on_progress=self._report_usage, transport_retries=0,
        )
        return runtime, HarborEnvironmentAdapter(self._environment, control,
                                                 command_timeout_sec=arguments.command_timeout_sec)

    def _report_usage(self, log: EpisodeLog) -> None:
        # Written from the worker thread while harbor waits, so a trial that times out
        # still reports the tokens it spent. Plain attribute stores; harbor only reads
        # the context after run() returns or is cancelled.
        usage = log.usage()
        self._context.n_input_tokens = usage.input_tokens
        self._context.n_cache_tokens = usage.cached_input_tokens
        self._context.n_output_tokens = usage.output_tokens

    def stop(self) -> None:
        self._note_cancelled()
        super().stop()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._provider.close()  # this episode's own: see WmoTrioHarborAgent.run

    def _note_cancelled(self) -> None:
        """Say, as the cancellation arrives, whether harbor's timeout sent it."""
        if self._cancel_reason is None:
            timed_out = self._timed_out is not None and self._timed_out()
            self._cancel_reason = CANCELLED_BY_HARBOR_TIMEOUT if timed_out else CANCELLED_BY_HARBOR

    def record(self, result: outcome.Outcome[RunResult], cancelled: bool) -> None:
        if cancelled:
            self._note_cancelled()
        log = self.log
        trace = trace_for(self.task_id, result, cancelled=self._cancel_reason if cancelled else None,
                          log=log)
        self._context.metadata = {**(self._context.metadata or {}),
                                  "stop_reason": str(trace.stop_reason), "turns": trace.turns}
        write_trace(self._logs_dir, trace)
        doc = self._arguments.harness
        write_trajectory(self._logs_dir, trace, TrajectoryInfo(
            agent_name=AGENT_NAME,
            agent_version=__version__,
            model_name=self._model_name,
            session_id=self._session_id,
            system_prompt=system_prompt(doc),
            instruction=self.instruction,
            tools=[tool_spec(name).model_dump() for name in doc.tools],
            extra={"candidate_doc_hash": doc.doc_hash, "harness": doc.name},
        ), log)
