"""The research API's pools in this process, its environments and its episode specs: see
`wmo_trio.research`."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import outcome
import trio

from wmo_trio.backends import Backend, build_execution, choice_may_block, choose_backend
from wmo_trio.control import CallControl
from wmo_trio.engine import call_asyncio, current_engine
from wmo_trio.episode._environment import (
    CommandResult,
    Environment,
    HarborShell,
    ShellEnvironment,
    command_timed_out,
    kill_process_group,
)
from wmo_trio.episode._execution import BackendEpisode, Execution
from wmo_trio.episode._tools import decode_output
from wmo_trio.harness import HarnessDoc, harness_from
from wmo_trio.models import RunResult
from wmo_trio.providers import Provider, ProviderConfig, build_provider
from wmo_trio.settings import (
    DEFAULT_COMMAND_TIMEOUT_SEC,
    DEFAULT_EPISODE_TIMEOUT_SEC,
    EpisodeSettings,
    PositiveInt,
    PositiveSeconds,
    checked,
)
from wmo_trio.trace import (
    CANCELLED_BY_CALLER,
    TraceIdentity,
    trace_for,
    trace_text,
    write_atomically,
)


@runtime_checkable
class TrioEnvironment(Protocol):
    """A task environment for trio code. `exec` runs a shell command within the
    environment's own command timeout; cancelling a call must stop its command."""

    async def exec(self, command: str) -> CommandResult: ...

    async def write_file(self, path: str, data: bytes) -> None: ...


class DirectoryEnvironment:
    """Commands run by `bash -c` in `workdir` with `trio.run_process`; each in its own
    process group, killed (children included) on timeout or cancellation.

    No isolation: the commands see this whole host. For trusted research runs."""

    def __init__(self, workdir: str | Path, *,
                 command_timeout_sec: float = DEFAULT_COMMAND_TIMEOUT_SEC) -> None:
        self.workdir = Path(workdir)
        self.command_timeout_sec: float = checked(PositiveSeconds, command_timeout_sec,
                                                  "command_timeout_sec")

    async def exec(self, command: str) -> CommandResult:
        limit = self.command_timeout_sec
        with trio.move_on_after(limit) as scope:
            completed = await trio.run_process(
                ["/bin/bash", "-c", command], cwd=self.workdir, capture_stdout=True,
                capture_stderr=True, check=False, stdin=b"", start_new_session=True,
                deliver_cancel=_kill_group,
            )
        if scope.cancelled_caught:
            raise command_timed_out(limit)
        return CommandResult(decode_output(completed.stdout), decode_output(completed.stderr),
                             completed.returncode)

    async def write_file(self, path: str, data: bytes) -> None:
        target = trio.Path(self.workdir) / path
        await target.parent.mkdir(parents=True, exist_ok=True)
        await target.write_bytes(data)


async def _kill_group(process: trio.Process) -> None:
    kill_process_group(process.pid)


class HarborEnvironment:
    """A harbor task environment (asyncio), for trio code running harbor under trio-asyncio
    (for example inside `run_harbor_job`, or `wmo_trio.engine.run_asyncio`). Its commands
    and writes are the harbor agent's own (`HarborShell`), run on harbor's loop."""

    def __init__(self, environment: Any, *,
                 command_timeout_sec: int = DEFAULT_COMMAND_TIMEOUT_SEC) -> None:
        self._shell = HarborShell(environment, command_timeout_sec=command_timeout_sec)
        self.command_timeout_sec = self._shell.command_timeout_sec

    async def exec(self, command: str) -> CommandResult:
        return await call_asyncio(self._shell.exec, command)

    async def write_file(self, path: str, data: bytes) -> None:
        await call_asyncio(self._shell.write_file, path, data)


class _TrioEnvironmentAdapter(ShellEnvironment):
    """The episode's (synchronous) view of a trio environment, from the worker thread."""

    def __init__(self, environment: TrioEnvironment, control: CallControl) -> None:
        self._environment = environment
        self._control = control

    def run_command(self, command: str) -> CommandResult:
        return self._control.run_async(self._environment.exec, command)

    def write_file_bytes(self, path: str, data: bytes) -> None:
        self._control.run_async(self._environment.write_file, path, data)


@dataclass
class EpisodeSpec:
    """One episode to run: what `EpisodePool.run` takes, as data for fan-out.
    `doc` names a document as the harbor agent's `harness` argument does
    (`wmo_trio.harness.document_form`: a document, a mapping, JSON text or a path);
    `episode_timeout` and `context_window` follow the harbor agent's rules
    (`wmo_trio.settings.EpisodeSettings`); `backend` is the harbor agent's
    `harness_backend` (None: `sandbox` for a `code:runtime` document where this machine
    can run it, else `local`; see `wmo_trio.backends`)."""

    doc: HarnessDoc | Mapping[str, Any] | str | Path
    provider: ProviderConfig | Mapping[str, Any] | Provider
    instruction: str
    environment: TrioEnvironment
    task_id: str = "episode"
    episode_timeout: float = DEFAULT_EPISODE_TIMEOUT_SEC
    trace_path: str | Path | None = None
    context_window: int | None = None
    backend: str | None = None


class _PoolEpisode(BackendEpisode):
    """An `Episode` (see `wmo_trio.engine.Episode`) for a trio-native environment."""

    def __init__(self, spec: EpisodeSpec, settings: EpisodeSettings, doc: HarnessDoc,
                 provider: Provider, backend: Backend, keep_trace: Callable[[str], None] | None) -> None:
        super().__init__(spec.task_id, spec.instruction)
        self.spec, self.settings, self.doc, self.provider = spec, settings, doc, provider
        self.backend, self.keep_trace = backend, keep_trace
        self.stop_is_quick = backend.abort_is_quick
        self.started_at = datetime.now(UTC)

    def start(self, control: CallControl) -> tuple[Execution, Environment]:
        execution = build_execution(self.doc, self.provider, self.settings, backend=self.backend.name,
                                control=control)
        return execution, _TrioEnvironmentAdapter(self.spec.environment, control)

    def record(self, result: outcome.Outcome[RunResult], cancelled: bool) -> None:
        if self.keep_trace is None:
            return
        identity = TraceIdentity(task_id=self.task_id, doc_hash=self.doc.doc_hash,
                                 model=self.provider.config.model_name,
                                 started_at=self.started_at, ended_at=datetime.now(UTC))
        trace = trace_for(identity, result,
                          cancelled=CANCELLED_BY_CALLER if cancelled else None, log=self.log)
        self.keep_trace(trace_text(trace))


class _Resolved:
    """Documents and providers of a pool, each resolved once, off the trio thread: a path
    is read, a provider built and prepared (its SDK imported: `Provider.prepare`) in a
    worker thread before its first episode runs, and closed with the pool.

    Episodes that start together with the same configuration wait for one build, so a
    fan-out of a thousand episodes builds each of its providers once."""

    def __init__(self) -> None:
        self._docs: dict[object, tuple[object, HarnessDoc]] = {}
        self._providers: dict[str, Provider] = {}
        self._given: dict[int, Provider] = {}  # callers' own providers, prepared once
        self._building: dict[object, trio.Lock] = {}

    async def doc(self, value: HarnessDoc | Mapping[str, Any] | str | Path) -> HarnessDoc:
        if isinstance(value, HarnessDoc):
            return value
        # A path or a JSON text is read once; a mapping is parsed once per object. A str and
        # a Path of the same characters may name different documents (harness_from's rule).
        key = value if isinstance(value, str | Path) else id(value)
        known = self._docs.get(key)
        if known is None or (not isinstance(key, str) and known[0] is not value):
            parsed = await trio.to_thread.run_sync(harness_from, value)
            known = self._docs[key] = (value, parsed)
        return known[1]

    async def backend(self, doc: HarnessDoc, backend: str | None) -> Backend:
        """`backend` checked, or chosen for `doc` when None; off the trio thread where that
        may look at the machine (the first look starts a sandbox)."""
        if choice_may_block(doc, backend):
            return await trio.to_thread.run_sync(choose_backend, doc, backend)
        return choose_backend(doc, backend)

    async def provider(self, value: ProviderConfig | Mapping[str, Any] | Provider) -> Provider:
        if not isinstance(value, ProviderConfig | Mapping):
            # The caller's own provider: prepared here, closed by the caller.
            if self._given.get(id(value)) is not value:
                async with self._building.setdefault(id(value), trio.Lock()):
                    if self._given.get(id(value)) is not value:
                        await trio.to_thread.run_sync(value.prepare)
                        self._given[id(value)] = value
            return value
        config = value.model_dump() if isinstance(value, ProviderConfig) else dict(value)
        key = json.dumps(config, sort_keys=True, default=str)
        provider = self._providers.get(key)
        if provider is None:
            async with self._building.setdefault(key, trio.Lock()):
                provider = self._providers.get(key)
                if provider is None:
                    provider = self._providers[key] = await trio.to_thread.run_sync(
                        _prepared_provider, config)
        return provider

    def close(self) -> None:
        for provider in self._providers.values():
            provider.close()


def _prepared_provider(config: dict[str, Any]) -> Provider:
    provider = build_provider(config)
    try:
        provider.prepare()
    except BaseException:
        provider.close()
        raise
    return provider


class Pool:
    """Runs episodes, at most `limit` at a time: in this process (`EpisodePool`) or on
    worker processes (`wmo_trio.research._fan_out.RemotePool`). Make one with
    `open_episode_pool`. A pool is `run_spec`; `run` and `fan_out` are the same for
    both."""

    limit: int

    async def run_spec(self, spec: EpisodeSpec) -> RunResult:
        raise NotImplementedError

    async def run(
        self,
        doc: HarnessDoc | Mapping[str, Any] | str | Path,
        provider: ProviderConfig | Mapping[str, Any] | Provider,
        instruction: str,
        environment: TrioEnvironment,
        *,
        task_id: str = "episode",
        episode_timeout: float = DEFAULT_EPISODE_TIMEOUT_SEC,
        trace_path: str | Path | None = None,
        context_window: int | None = None,
        backend: str | None = None,
    ) -> RunResult:
        """Run one episode and return its result.

        The arguments, the document and the provider are validated first (errors are
        raised before anything runs; `episode_timeout`, `context_window` and `backend` by
        the harbor agent's rules: see `EpisodeSpec`). If the calling scope is cancelled,
        the episode is stopped, its worker waited for, its trace written (a partial one)
        under a shield, and `trio.Cancelled` propagates. An exception from the episode is
        raised as itself.
        """
        return await self.run_spec(EpisodeSpec(
            doc, provider, instruction, environment, task_id=task_id,
            episode_timeout=episode_timeout, trace_path=trace_path, context_window=context_window,
            backend=backend))

    async def started(self, specs: list[EpisodeSpec]) -> None:
        """Before a fan-out starts any of `specs`: refuse what this pool cannot run."""

    @asynccontextmanager
    async def fan_out(
        self, specs: Iterable[EpisodeSpec]
    ) -> AsyncIterator[trio.MemoryReceiveChannel[tuple[EpisodeSpec, outcome.Outcome[RunResult]]]]:
        """Start every episode; the block receives `(spec, outcome)` pairs as episodes
        finish: `outcome.Value(RunResult)`, or `outcome.Error` for one that raised. The
        channel closes after the last one.

        Leaving the block cancels the episodes still running, with the engine's guarantees
        (stopped, waited for, traces written), before the block's exit returns.
        """
        specs = list(specs)
        await self.started(specs)
        send, receive = trio.open_memory_channel[tuple[EpisodeSpec, outcome.Outcome[RunResult]]](
            math.inf)

        async def one(spec: EpisodeSpec,
                      channel: trio.MemorySendChannel[tuple[EpisodeSpec, outcome.Outcome[RunResult]]],
                      ) -> None:
            async with channel:
                result = await outcome.acapture(self.run_spec, spec)
                if isinstance(result, outcome.Error) and isinstance(result.error, trio.Cancelled):
                    result.unwrap()  # our own cancellation: let it propagate
                channel.send_nowait((spec, result))

        async with trio.open_nursery() as nursery:
            async with send:
                for spec in specs:
                    nursery.start_soon(one, spec, send.clone())
            try:
                yield receive
            finally:
                nursery.cancel_scope.cancel()


class EpisodePool(Pool):
    """Runs episodes on this process's engine, at most `limit` at a time."""

    def __init__(self, limit: int) -> None:
        self.limit = checked(PositiveInt, limit, "limit")
        self._limiter = trio.CapacityLimiter(self.limit)
        self._resolved = _Resolved()
        current_engine().ensure_workers(self.limit)

    async def run_spec(self, spec: EpisodeSpec) -> RunResult:
        keep = None if spec.trace_path is None else partial(write_atomically, Path(spec.trace_path))
        return await self.run_keeping_trace(spec, keep)

    async def run_keeping_trace(self, spec: EpisodeSpec,
                                keep_trace: Callable[[str], None] | None) -> RunResult:
        """`run_spec`, the trace's text handed to `keep_trace` (in the episode's worker
        thread, shielded as a trace write is) instead of written at `spec.trace_path`: a
        worker process sends it to the pool's driver."""
        settings: EpisodeSettings = EpisodeSettings.parse(
            {"episode_timeout": spec.episode_timeout, "context_window": spec.context_window})
        doc = await self._resolved.doc(spec.doc)
        backend = await self._resolved.backend(doc, spec.backend)
        provider = await self._resolved.provider(spec.provider)
        episode = _PoolEpisode(spec, settings, doc, provider, backend, keep_trace)
        async with self._limiter:
            return await current_engine().run_episode(episode, workers=self.limit)

@asynccontextmanager
async def open_local_pool(limit: int = 64) -> AsyncIterator[EpisodePool]:
    """A pool of at most `limit` concurrent episodes for this block; cancelling the
    enclosing scope cancels its episodes with the engine's guarantees. Opening it starts
    the engine's worker threads for `limit` episodes, so a fan-out starts at once."""
    pool = EpisodePool(limit)
    await current_engine().prepare(pool.limit)
    try:
        yield pool
    finally:
        pool._resolved.close()

