"""`WmoTrioHarborAgent`: one harness candidate, run as a harbor agent on the trio engine.

Harbor owns the task environment and the verifier; this agent runs the episode host-side.
Every keyword argument is checked in the constructor, so a bad candidate or configuration
fails before harbor starts a single container; the arguments and their checks are
`wmo_trio._agent_arguments`'s, which `wmo-trio run` makes before it loads harbor. The
constructor does no I/O beyond reading a document file once per process (harbor builds it
on its event loop): the provider's SDK is imported, and its client built, in a worker
thread on the first model call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import outcome
from harbor.agents.base import BaseAgent
from harbor.agents.capabilities import AgentCapabilities
from harbor.agents.options import AgentOptions
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext

from wmo_trio import __version__
from wmo_trio._agent_arguments import AGENT_NAME as AGENT_NAME
from wmo_trio._agent_arguments import (
    AgentArguments,
    check_model_name_matches,
    parse_arguments,
    portable_arguments,
    provider_for,
)
from wmo_trio.backends import build_execution, unisolated_code_warning
from wmo_trio.control import CallControl
from wmo_trio.engine import host_for_running_loop, settle_heap
from wmo_trio.episode._environment import Environment
from wmo_trio.episode._execution import BackendEpisode, Execution
from wmo_trio.episode._log import EpisodeLog
from wmo_trio.episode._services import system_prompt
from wmo_trio.episode._tools import tool_spec
from wmo_trio.harbor._adapter import HarborEnvironmentAdapter
from wmo_trio.harbor._identity import (
    HarborTrial,
    harbor_trial,
    pin_document,
    record_identity_in_locks,
)
from wmo_trio.harbor._timeout import harbor_agent_timeout
from wmo_trio.harbor._trajectory import TrajectoryInfo, write_trajectory
from wmo_trio.harness import HarnessDoc, HarnessError, harness_from
from wmo_trio.models import RunResult
from wmo_trio.providers import Provider, ProviderConfigError, parse_provider_config
from wmo_trio.trace import (
    CANCELLED_BY_HARBOR,
    CANCELLED_BY_HARBOR_TIMEOUT,
    TraceIdentity,
    trace_for,
    write_trace,
)

log = logging.getLogger("wmo_trio.harbor")


def _no_agent_environment(env: Mapping[str, str] | None) -> None:
    if env:
        raise ValueError(
            f"agent environment (--ae / extra_env) is not supported: wmo_trio does not inject "
            f"agent environment variables (got {sorted(env)}); remove them from the agent config")


def _lock_identity(agent_class: type, kwargs: Mapping[str, Any]) -> str | None:
    """The `doc_hash` harbor's trial locks identify this agent by (see `_identity`)."""
    if not issubclass(agent_class, WmoTrioHarborAgent):
        return None
    try:
        return harness_from(kwargs.get("harness")).doc_hash
    except (HarnessError, ValueError):
        return None  # its preflight says what is wrong with the document


class WmoTrioHarborAgent(BaseAgent):  # type: ignore[misc]  # harbor ships no type information
    """Runs a serialized harness candidate while harbor owns the task and the verifier.

    Use it with `harbor run -a wmo_trio.harbor:WmoTrioHarborAgent -m <kind>/<model>
    --ak harness=<doc or path> --ak provider_config=<json>`. The trace `wmo-run.json` and an
    ATIF `trajectory.json` are written to `logs_dir` for every trial, timeouts included.
    """

    capabilities: ClassVar[AgentCapabilities] = AgentCapabilities(atif=True)
    options_model: ClassVar[type[AgentOptions]] = AgentArguments

    def __init__(self, logs_dir: Path, model_name: str | None = None, **kwargs: Any) -> None:
        """harbor checks the arguments against `AgentArguments` (`parse_options`); the
        checks that depend on this process follow, each a `ValueError` naming its argument.

        harbor's own arguments (`logger`, `mcp_servers`, `skills_dir`, and whatever later
        releases add to `BaseAgent`) are `BaseAgent`'s, untouched.
        """
        super().__init__(logs_dir, model_name, **kwargs)
        arguments: AgentArguments = self.options
        _no_agent_environment(self._extra_env)
        self._arguments = arguments
        self._provider = provider_for(arguments, model_name)
        # Before the burst of agents a harbor job constructs: each construction otherwise
        # ran the collector's full passes over every agent made so far.
        settle_heap()
        warning = unisolated_code_warning(arguments.harness, arguments.backend)
        if warning is not None:
            self.logger.warning("harness %s: %s", arguments.harness.name, warning)

    @classmethod
    def parse_options(cls, kwargs: dict[str, Any] | None = None,
                      env: Mapping[str, str] | None = None) -> AgentArguments:
        """harbor's hook for checking an agent's options, at preflight and in the
        constructor: one line naming each bad argument (an unknown one with the closest
        known name), in place of harbor's generic listing."""
        return parse_arguments(kwargs)

    @classmethod
    def portable_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments as they travel to a worker process on another machine
        (`wmo_trio.cluster`): the document, and a scripted provider's script, inline."""
        return portable_arguments(kwargs)

    @classmethod
    def preflight(cls, kwargs: dict[str, Any] | None = None,
                  env: Mapping[str, str] | None = None) -> None:
        """Harbor calls this once per job, before any trial, and prints a `ValueError` as
        one line: every argument is checked here, and the files trials need (the document,
        a provider's script) are read now, so no trial reads them on harbor's loop. The
        document's `doc_hash` is then recorded in the job's agent configuration (see
        `_identity`). The model name is checked in `check_model_credentials`, harbor's
        hook that is given it."""
        super().preflight(kwargs, env)
        _no_agent_environment(env)
        arguments = cls.parse_options(kwargs, env)
        provider_for(arguments, None, check_model_name=False)
        pin_document(kwargs, arguments.harness.doc_hash, WmoTrioHarborAgent)

    @classmethod
    def check_model_credentials(cls, connection: Any, *, kwargs: dict[str, Any],
                                env: Mapping[str, str],
                                explicit_env: Mapping[str, str] | None = None) -> None:
        """`-m` must be `<kind>/<model>` of `provider_config`: checked before the job, as
        harbor passes the model name to this hook (not to `preflight`)."""
        given = kwargs.get("provider_config")
        if not isinstance(given, dict):
            return  # its preflight, which harbor runs first, said what is wrong with it
        try:
            config = parse_provider_config(given)
        except (ProviderConfigError, TypeError, ValueError):
            return  # its preflight, which harbor runs first, said what is wrong with it
        check_model_name_matches(kwargs.get("model_name"), config)

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
        # First, before anything waits: harbor's timeout, found above run() (_timeout.py).
        timed_out = harbor_agent_timeout()
        context.metadata = {**(context.metadata or {}), "candidate_doc_hash": self.doc.doc_hash}
        trial = harbor_trial(environment, context_id=self.context_id, session_id=self.session_id)
        # Harbor builds an agent per trial and runs it once: its episode takes over the
        # provider and closes it in its cleanup.
        episode = HarborEpisode(
            self._arguments, self.model_name, self._provider, instruction, environment, context,
            logs_dir=Path(self.logs_dir), trial=trial,
            session_id=self.session_id, timed_out=timed_out,
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


class HarborEpisode(BackendEpisode):
    """One trial's episode, as the engine drives it (see `wmo_trio.engine.Episode`). It owns
    `provider`, which it closes in its cleanup.

    When harbor cancels the agent: the engine interrupts the episode's control (which
    cancels the environment command in flight) and `stop()` aborts the execution; the engine
    waits for the worker, then `close()` and `record()` run shielded, then the cancellation
    propagates. The partial trace says whether harbor's agent timeout or something else
    (an interrupted `harbor run`) cancelled it.
    """

    def __init__(self, arguments: AgentArguments, model_name: str | None, provider: Provider,
                 instruction: str, environment: BaseEnvironment, context: AgentContext, *,
                 logs_dir: Path, trial: HarborTrial, session_id: str | None,
                 timed_out: Callable[[], bool] | None) -> None:
        # The execution's own id for the episode (an E2B sandbox's metadata): the trial's.
        super().__init__(trial.trial_id or trial.trial_name or "harbor-task", instruction)
        self._trial = trial
        self._started_at = datetime.now(UTC)
        self._arguments = arguments
        self._model_name = model_name
        self._provider = provider
        self._environment = environment
        self._context = context
        self._logs_dir = logs_dir
        self._session_id = session_id
        self._timed_out = timed_out
        self.stop_is_quick = arguments.backend.abort_is_quick
        self._cancel_reason: str | None = None

    def start(self, control: CallControl) -> tuple[Execution, Environment]:
        arguments = self._arguments
        execution = build_execution(
            arguments.harness, self._provider, arguments, backend=arguments.backend.name,
            backend_settings=arguments.backend_settings, control=control,
            on_progress=self._report_usage,
        )
        return execution, HarborEnvironmentAdapter(self._environment, control,
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
        trial = self._trial
        identity = TraceIdentity(
            task_id=trial.task_id if trial.task_id is not None else self.task_id,
            trial_id=trial.trial_id, trial_name=trial.trial_name, task_name=trial.task_name,
            doc_hash=self._arguments.harness.doc_hash,
            model=self._arguments.provider_config.model_name,
            started_at=self._started_at, ended_at=datetime.now(UTC))
        trace = trace_for(identity, result, cancelled=self._cancel_reason if cancelled else None,
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


# From the moment the agent can be named in a job, harbor's trial locks identify it by its
# document (see `_identity`).
record_identity_in_locks(_lock_identity)
