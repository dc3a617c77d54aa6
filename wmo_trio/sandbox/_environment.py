"""``LocalEnvironment``: harbor's environment interface over a sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.environments.definition import require_agent_environment_definition
from harbor.models.job.config import JobConfig
from harbor.models.task.config import NetworkMode
from harbor.models.trial.config import ResourceMode
from harbor.models.trial.paths import EnvironmentPaths
from harbor.utils.path_filter import filter_paths_by_patterns

from wmo_trio.sandbox import _transfer, _upload
from wmo_trio.sandbox._build import ImageConfig
from wmo_trio.sandbox._cgroup import host_cgroups
from wmo_trio.sandbox._errors import ChannelClosed, DockerfileError, SpawnFailed, unavailable
from wmo_trio.sandbox._image import Image, ImageCache
from wmo_trio.sandbox._namespace import Sandbox, missing_tools
from wmo_trio.sandbox._options import (
    DEFAULT_PIDS_LIMIT,
    DEFAULT_SHM_SIZE_MB,
    Ceilings,
    EnvironmentOptions,
)
from wmo_trio.sandbox._overlay import SandboxRoot, container_etc_files
from wmo_trio.sandbox._profile import DEFAULT_PATH, TRIAL_PROFILE, Bind
from wmo_trio.sandbox._reward import download_with_rewards
from wmo_trio.sandbox._rootfs import HostLayers
from wmo_trio.sandbox._state import StateDir
from wmo_trio.sandbox._sweep import sweep_and_find_layers
from wmo_trio.sandbox._threads import made_in_thread
from wmo_trio.sandbox._transfer import tar_excluded

__all__ = ["LocalEnvironment"]

ENTRYPOINT_LOG = "sandbox-entrypoint.log"
# How much of each of the ENTRYPOINT's streams its log keeps: a service that floods
# its output must not fill the jobs directory.
ENTRYPOINT_LOG_LIMIT = 4 << 20
BUILD_LOG = "sandbox-build.log"
# What harbor's Docker environment runs as the container's command; an ENTRYPOINT
# receives it as its arguments.
KEEPALIVE = ["sh", "-c", "sleep infinity"]
# Tasks whose limits this process already said it cannot enforce: once each, not per trial.
_WARNED_UNENFORCED: set[str] = set()
# What this process already said once, not per trial: the auto_mounting refusal, and
# the tasks whose image's sudo cannot work here.
_SAID_ONCE: set[str] = set()
# Harbor would bind the trial's log directories to world-writable host directories and
# read what the trial leaves there on the host, following the trial's symlinks.
AUTO_MOUNTING_REFUSED = (
    "LocalEnvironment refuses --ek auto_mounting=true: the trial would write straight into "
    "world-writable host directories that harbor reads, following the trial's links; leave "
    "it out and harbor copies the logs out of each trial instead")
COMPOSE_REFUSED = (
    "LocalEnvironment does not run Docker Compose task environments; use harbor's Docker "
    "environment (-e docker)")


class LocalEnvironment(BaseEnvironment):  # type: ignore[misc]
    """Harbor environment that builds the task's Dockerfile and runs each trial in a
    bubblewrap sandbox, without Docker.

    Select it with ``harbor run -e wmo_trio.harbor:LocalEnvironment``.

    - **The host's userland is the base image.** ``FROM`` is not pulled: the host's
      ``/usr``, ``/etc``, ``/var`` and ``/opt`` stand in for it, read-only. The other
      instructions are built once per image and cached (``wmo-trio sandbox images``).
    - Each trial has a private overlay root, PID, IPC, UTS, mount, cgroup and network
      namespaces, a fresh ``/proc``, a minimal ``/dev``, only the task's and harbor's
      environment variables, outbound network through slirp4netns unless the task
      forbids it, ``cpus`` and ``memory_mb`` as cgroup ceilings where this machine's
      cgroups allow them, and ``storage_mb`` as the size of a filesystem of its own
      for what it writes where loop devices allow it. Nothing of the host's ``/tmp``,
      ``/root``, ``/home``, the project, the job's datasets and tasks or the jobs
      directory is visible.
    - It runs as root on Linux with bubblewrap, slirp4netns and util-linux; elsewhere
      ``preflight`` and ``start`` fail with one error pointing to ``-e docker``.
    - ``--ek auto_mounting=true`` is refused (each trial fails with one line): harbor
      would make the trial's host directories world-writable and read what the trial
      left there through its links. Harbor is told nothing is mounted, so it copies
      the logs out of the trial.
    - ``--ek state_dir=...`` (default ``$TMPDIR/wmo-trio-sandbox``) holds trials' upper
      directories, ``--ek cache_dir=...`` (default ``~/.cache/wmo-trio/sandbox``) the
      built images, ``--ek build_args='{"NAME": "value"}'`` sets ``ARG`` values.
      ``stop(delete=False)`` keeps the trial's upper directories for inspection (with
      ``storage_mb``, in an ext4 image, ``storage.img``: ``mount -o loop,ro`` reads it).
    - Files are copied in and out by this process, never by a program of the trial's
      root. A copy out keeps links only when they stay inside the copied directory and
      is bounded: ``--ek download_limit_mb=...`` (default 1024, holes counted) and
      ``--ek download_timeout_sec=...`` (default 300) per download; what fits is
      copied, then one error says what was left out.
    """

    def __init__(
        self,
        *args: Any,
        state_dir: str | Path | None = None,
        cache_dir: str | Path | None = None,
        build_args: Mapping[str, str] | str | None = None,
        download_limit_mb: float | str | None = None,
        download_timeout_sec: float | str | None = None,
        pids_limit: int | str = DEFAULT_PIDS_LIMIT,
        shm_size_mb: int | str = DEFAULT_SHM_SIZE_MB,
        **kwargs: Any,
    ) -> None:
        self._options = EnvironmentOptions.parse(
            state_dir=state_dir, cache_dir=cache_dir, build_args=build_args,
            download_limit_mb=download_limit_mb, download_timeout_sec=download_timeout_sec,
            pids_limit=pids_limit, shm_size_mb=shm_size_mb)
        self._cache = ImageCache(self._options.cache_dir)
        # Taken from harbor before it sees it: harbor would make the trial's host
        # directories world-writable when it made the environment. Every start of the
        # trial is refused instead, in one line (harbor has no preflight that sees the
        # environment's options, and an error raised here ends the job in a traceback).
        self._refusal: str | None = None
        if kwargs.pop("auto_mounting", False) is True:
            self._refusal = AUTO_MOUNTING_REFUSED
            if "auto_mounting" not in _SAID_ONCE:
                _SAID_ONCE.add("auto_mounting")
                logging.getLogger(__name__).error("%s", AUTO_MOUNTING_REFUSED)
        self._sandbox: Sandbox | None = None
        # What the running trial holds (its sandbox and directory, the image's and host
        # layers' leases, its ENTRYPOINT), from its start to its stop.
        self._held = contextlib.AsyncExitStack()
        self._started = False  # a sandbox ran, whether or not it still does
        self._said_not_started = False
        self._config = ImageConfig()
        self._shell = "sh"
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "wmo-trio-local"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # Not mounted: harbor then copies every log directory out through download_dir
        # and never reads a host path a trial could have written (a bind mount it asked
        # for with --mounts still binds, but harbor does not read through it).
        return EnvironmentCapabilities(mounted=False, disable_internet=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        # Hard ceilings where this machine's cgroups allow them (see _cgroup); no
        # reservations.
        cgroups = host_cgroups()
        return EnvironmentResourceCapabilities(
            cpu_limit=cgroups.offers("cpu"), memory_limit=cgroups.offers("memory"),
            fractional_cpus=True)

    def _ceilings(self) -> Ceilings:
        """The trial's ceilings as harbor resolves them (task.toml's ``cpus``,
        ``memory_mb`` and ``storage_mb``, overrides, the enforcement policy) and
        ``pids_limit``, as this machine holds them; what it cannot is said once per
        task."""
        ceilings = Ceilings.held(
            cpus=self._resource_limit_value("cpu", auto_mode=ResourceMode.LIMIT),
            memory_mb=self._resource_limit_value("memory", auto_mode=ResourceMode.LIMIT),
            pids=self._options.pids_limit or None, storage_mb=self._effective_storage_mb)
        if ceilings.unenforced and self.environment_name not in _WARNED_UNENFORCED:
            _WARNED_UNENFORCED.add(self.environment_name)
            self.logger.warning("%s: %s not enforced: %s", self.environment_name,
                                " and ".join(ceilings.unenforced), "; ".join(ceilings.reasons))
        return ceilings

    @classmethod
    def preflight(cls) -> None:
        """Fail the job early, before any trial is queued, if no trial could start."""
        reason = missing_tools()
        if reason is not None:
            raise SystemExit(str(unavailable(reason)))

    def _validate_definition(self) -> None:
        if (self.environment_dir / "docker-compose.yaml").exists():
            # The trial's start is refused, not the environment's making: raised here, it
            # would end the whole job in harbor's traceback, its other tasks' trials lost.
            self._refusal = COMPOSE_REFUSED
            return
        require_agent_environment_definition(
            self.environment_dir, docker_image=self.task_env_config.docker_image
        )
        for mount in self._mounts:
            if mount["type"] != "bind":
                raise ValueError(
                    f"LocalEnvironment supports only bind mounts, not {mount['type']!r} "
                    f"(target {mount['target']})."
                )

    # ------------------------------------------------------------------ lifecycle

    @property
    def _network(self) -> bool:
        return bool(self._network_policy.network_mode != NetworkMode.NO_NETWORK)

    def _hidden_paths(self) -> list[Path]:
        """Host paths no sandbox may see, wherever they are (only those inside the
        host's system directories need hiding: nothing else of the host is a layer).

        Harbor's: every task of the job and the dataset holding it, so no trial reads
        another task's solution or tests, and the jobs directory, so none reads another
        trial or job. This process's: the sandboxes' state and cache, the working
        directory, a virtualenv, the project's checkout.
        """
        task_dir = next((path for path in self.environment_dir.parents
                         if (path / "task.toml").is_file()), self.environment_dir.parent)
        job_dir = self.trial_paths.trial_dir.parent
        named = [*_job_sources(job_dir / "config.json"), task_dir]
        paths = [*named, *(path.parent for path in named if (path / "task.toml").is_file()),
                 task_dir.parent, job_dir, job_dir.parent, self._options.state_root,
                 self._cache.root, Path.cwd()]
        if sys.prefix != sys.base_prefix:  # a base Python is part of the host's userland
            paths.append(Path(sys.prefix))
        project = Path(__file__).resolve().parents[2]
        if (project / "pyproject.toml").is_file():  # a checkout, not site-packages
            paths.append(project)
        return paths

    async def start(self, force_build: bool) -> None:
        """Build the image if no trial did yet (or ``force_build``), then start the
        trial's sandbox and the image's ``ENTRYPOINT``.

        Raises :class:`SandboxUnavailableError` when this machine cannot do it, and
        a ``BuildError`` naming the failed Dockerfile step. If cancelled meanwhile, the
        half-started sandbox and its directory are removed.
        """
        if self._refusal is not None:
            raise ValueError(self._refusal)
        if self._sandbox is not None:
            raise RuntimeError(f"environment {self.session_id} is already started")
        reason = missing_tools()
        if reason is not None:
            raise unavailable(reason)
        # What the trial holds from here to its stop, in the order it is let go there.
        async with contextlib.AsyncExitStack() as on_fail:
            storage = self._effective_storage_mb is not None
            host = await made_in_thread(lambda: sweep_and_find_layers(
                self._options.state_root, self._cache, self._hidden_paths(), storage=storage),
                HostLayers.release)
            on_fail.callback(host.release)
            image: Image | None = None
            if (self.environment_dir / "Dockerfile").is_file():
                if force_build:
                    self.logger.debug("force_build: the cached image is reused; prune the "
                                      "cache (wmo-trio sandbox prune) to rebuild it")
                image = await self._build_image(host)
                on_fail.callback(image.release)
                self._config = image.config
                self._warn_about_sudo(image)
            elif self.task_env_config.docker_image:
                self.logger.debug("docker_image %s: the host's userland stands in for it",
                                  self.task_env_config.docker_image)
            state, binds = await made_in_thread(self._state_and_binds,
                                                lambda made: made[0].close())
            await on_fail.enter_async_context(state)
            hostname = hashlib.sha256(self.session_id.encode()).hexdigest()[:12]
            ceilings = self._ceilings()
            root = SandboxRoot(host, image.layer if image else None, tuple(binds),
                               container_etc_files(hostname, network=self._network),
                               ceilings.storage_bytes)
            profile = dataclasses.replace(TRIAL_PROFILE, limits=ceilings.limits,
                                          shm_bytes=self._options.shm_bytes(ceilings.limits))
            on_fail.callback(self._forget_sandbox)  # after it stops, if the start fails
            self._sandbox = await on_fail.enter_async_context(await Sandbox.launch(
                state, root, hostname=hostname, network=self._network, profile=profile))
            self._started = True
            await self._prepare(on_fail)
            self._held = on_fail.pop_all()
        await self._upload_environment_dir_after_start()

    def _state_and_binds(self) -> tuple[StateDir, list[Bind]]:
        with contextlib.ExitStack() as on_fail:
            state = on_fail.enter_context(StateDir.create(self._options.state_root,
                                                          self.session_id))
            binds = self._binds()
            on_fail.pop_all()
        return state, binds

    async def _build_image(self, host: Any) -> Image:
        log_path = self.trial_paths.trial_dir / BUILD_LOG
        log = await asyncio.to_thread(log_path.open, "w")
        with log:
            try:
                return await self._cache.ensure(
                    self.environment_dir, host, task_name=self.environment_name,
                    build_args=self._options.build_args,
                    build_timeout_sec=self.task_env_config.build_timeout_sec, log=log,
                    notice=lambda text: self.logger.warning("%s: %s", self.environment_name, text),
                    built_for={"task": str(self.environment_dir.parent),
                               "job": str(self.trial_paths.trial_dir.parent)},
                )
            except TimeoutError:
                raise RuntimeError(
                    f"building the image of {self.environment_name} took longer than its "
                    f"build_timeout_sec ({self.task_env_config.build_timeout_sec:g} s)"
                ) from None
            except DockerfileError as error:
                raise ValueError(f"{self.environment_dir / 'Dockerfile'}: {error}") from None
            finally:
                if log.tell() == 0:
                    log_path.unlink(missing_ok=True)

    def _warn_about_sudo(self, image: Image) -> None:
        user = image.config.user
        if (not image.has_sudo or user is None or user.partition(":")[0] in ("root", "0")
                or f"sudo:{self.environment_name}" in _SAID_ONCE):
            return
        _SAID_ONCE.add(f"sudo:{self.environment_name}")
        self.logger.warning(
            "%s: sudo does not work for the image's USER %s here: bubblewrap sets no_new_privs, "
            "so setuid programs gain no privileges; run the task with -e docker where it "
            "needs sudo", self.environment_name, user)

    def _binds(self) -> list[Bind]:
        binds = []
        for mount in self._host_mounts:
            source = Path(mount["source"])
            if not source.exists():
                if mount.get("bind", {}).get("create_host_path") is False:
                    raise FileNotFoundError(f"bind mount source {source} does not exist")
                source.mkdir(parents=True, exist_ok=True)
            binds.append(Bind(str(source.resolve()), mount["target"],
                              bool(mount.get("read_only"))))
        return binds

    @property
    def _default_workdir(self) -> str:
        return self.task_env_config.workdir or self._config.workdir or "/"

    async def _prepare(self, held: contextlib.AsyncExitStack) -> None:
        """Create the working directory and world-writable mount targets (as Docker's
        start does), pick the shell, start the ENTRYPOINT (``held`` waits for its end,
        once the sandbox stopped)."""
        sandbox = self._require_sandbox()
        # Harbor's log directories are there even when harbor named no mounts (it names
        # them for its trials; an environment made on its own gets them too).
        paths = EnvironmentPaths.for_os(self.os)
        targets = dict.fromkeys([*self._mount_targets(writable_only=True),
                                 *map(str, (paths.agent_dir, paths.verifier_dir,
                                            paths.artifacts_dir))])
        # By the helper itself: a shell and a mkdir and chmod per directory cost more
        # than the rest of the start.
        self._shell = await sandbox.channel.prepare([self._default_workdir], list(targets))
        entrypoint = self._config.entrypoint
        if entrypoint:
            shell = self._config.shell
            shell_form = entrypoint[: len(shell)] == shell and len(entrypoint) == len(shell) + 1
            argv = entrypoint if shell_form else entrypoint + KEEPALIVE
            log = (self.trial_paths.trial_dir / ENTRYPOINT_LOG).open("a", encoding="utf-8")
            task = asyncio.get_running_loop().create_task(self._run_entrypoint(argv, log))

            async def ended() -> None:  # the container's main process ends with it
                await sandbox.stop()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

            held.push_async_callback(ended)

    async def _run_entrypoint(self, argv: list[str], log: Any) -> None:
        """The container's main process: it runs until the trial stops. Its output
        goes to its log as it comes, the first ENTRYPOINT_LOG_LIMIT bytes of each
        stream; none is kept in memory."""

        async def write(text: str, stream: str) -> None:
            log.write(text)
            log.flush()

        sandbox = self._require_sandbox()
        try:
            with log:
                completed = await sandbox.channel.run(
                    argv, env=self._base_env(), cwd=self._config.workdir or "/",
                    user=self._config.user, output_limit=0, callback=write,
                    stream_limit=ENTRYPOINT_LOG_LIMIT,
                )
                self.logger.debug("the ENTRYPOINT exited with %d", completed.return_code)
        except Exception as error:
            if sandbox.stopped:  # it ends with the trial, as a container's main process does
                self.logger.debug("the ENTRYPOINT ended with the trial: %s", error)
            else:  # the trial goes on, as a container whose main process died
                self.logger.warning("the ENTRYPOINT failed: %s", error)

    async def stop(self, delete: bool) -> None:
        """End every process of the trial; remove its upper directories unless
        ``delete`` is false, in which case they are kept for inspection. Once it
        returns, no process of the trial runs; the directories go in a thread of their
        own meanwhile, which this process waits for at its exit
        (``wmo_trio.sandbox.wait_for_removals``).

        Safe to call twice or without ``start``.
        """
        sandbox, self._sandbox = self._sandbox, None
        held, self._held = self._held, contextlib.AsyncExitStack()
        # Whatever happens here, the rest of what the trial holds is let go at the end,
        # in the reverse of the start's order: the ENTRYPOINT, the sandbox, its state
        # directory (removed if not handed on), the image's lease, the host layers'.
        async with held:
            if sandbox is None:
                return
            await sandbox.stop(linger=delete)
            if delete:
                # There too: slirp4netns's exit, and the overlays' unmounting before
                # their directories go.
                sandbox.state.remove_later(first=sandbox.take_leftovers().close)
            else:
                kept = await asyncio.to_thread(sandbox.keep_changes)
                self.logger.info("Kept the trial's filesystem changes in %s", kept)

    def _forget_sandbox(self) -> None:
        self._sandbox = None

    def _require_sandbox(self) -> Sandbox:
        if self._sandbox is None:
            raise RuntimeError(f"environment {self.session_id} is not started")
        return self._sandbox

    # ------------------------------------------------------------------ exec

    def _base_env(self) -> dict[str, str]:
        return {"PATH": DEFAULT_PATH, **self._config.env}

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run ``command`` with bash (sh if the image has no bash) inside the trial.

        ``cwd`` defaults to the task's workdir; ``env`` is merged over the image's
        ``ENV`` and harbor's persistent and scoped variables; ``user`` (name, uid, or
        ``name:group``) defaults to harbor's default user, else the image's ``USER``,
        else root. Output keeps its head and tail, 4 MiB a stream at most; a cut is
        said at the end of stderr.

        On timeout every process the command started is killed and
        ``RuntimeError("Command timed out after N seconds")`` is raised, as harbor's
        Docker environment does. If cancelled, the same processes are killed before
        the cancellation propagates.
        """
        sandbox = self._require_sandbox()
        variables = self._base_env()
        variables.update(self._merge_env(env) or {})
        for key in variables:
            if not key or "=" in key or "\0" in key + variables[key]:
                raise ValueError(f"invalid environment variable {key!r}")
        spec = self._resolve_user(user)
        try:
            completed = await sandbox.channel.run(
                [self._shell, "-c", command], env=variables, cwd=cwd or self._default_workdir,
                user=spec if spec is not None else self._config.user, timeout_sec=timeout_sec,
                callback=self._output_callback(),
            )
        except SpawnFailed as error:
            return ExecResult(stdout=None, stderr=str(error), return_code=error.code)
        except ChannelClosed as error:
            if sandbox.stopped:
                raise
            raise ChannelClosed(await sandbox.death()) from error
        except TimeoutError:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from None
        return ExecResult(
            stdout=completed.stdout.decode(errors="replace") if completed.stdout else None,
            stderr=completed.stderr.decode(errors="replace") if completed.stderr else None,
            return_code=completed.return_code,
        )

    # ------------------------------------------------------------------ files

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """Copy a host file into the trial, owned by root, mode kept. A target that is
        a directory (or ends with ``/``) receives the file under its own name."""
        await _upload.upload_file(self._require_sandbox().open_root, Path(source_path),
                                    target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """Copy a host directory's contents into ``target_dir`` (created if needed),
        owned by root, modes kept."""
        await _upload.upload_dir(self._require_sandbox().open_root, Path(source_dir),
                                   target_dir)

    def _nothing_to_copy(self) -> bool:
        """Whether there is nothing to copy out because no sandbox runs: the trial never
        started (its build failed), or its start failed or was cancelled halfway and its
        sandbox is gone (harbor then still asks for the logs). Said in one line for the
        trial, since harbor logs a raised error with its traceback (and the build's)."""
        if self._sandbox is not None:
            return False
        if not self._said_not_started and self._refusal is None:
            self.logger.warning("nothing to copy out of %s: its environment %s",
                                self.session_id,
                                "has stopped" if self._started else "did not start")
        self._said_not_started = True
        return True

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        """Copy a file out of the trial (within the download limits); the host copy
        belongs to harbor's user. Nothing is copied (and nothing raised) when no sandbox
        runs."""
        if self._nothing_to_copy():
            return
        await _transfer.download_file(self._require_sandbox().open_root, source_path,
                                      Path(target_path), self._options.transfer_limits)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Copy a directory's contents out of the trial into ``target_dir``: what fits
        the download limits, then ``TransferIncomplete`` if anything was left out."""
        await self._download(source_dir, target_dir)

    async def download_dir_with_exclusions(self, *, source_dir: str, target_dir: Path | str,
                                           exclude: list[str]) -> None:
        """``download_dir`` without the entries ``exclude`` matches (as tar's
        ``--exclude`` does: any trailing part of a path, a directory with its contents)."""
        await self._download(source_dir, target_dir,
                             exclude=lambda path: tar_excluded(path, exclude))

    async def download_dir_filtered(
        self, *, source_dir: str, target_dir: Path | str,
        include: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
        protect: Sequence[str] | None = None,
    ) -> None:
        """The regular files of ``source_dir`` that harbor's include and exclude
        patterns select, and the ``protect`` paths whatever they say."""

        def select(path: str) -> bool:
            return path in (protect or ()) or bool(
                filter_paths_by_patterns([path], include=include, exclude=exclude))

        await self._download(source_dir, target_dir, select=select)

    async def _download(self, source_dir: str, target_dir: Path | str,
                        exclude: Callable[[str], bool] | None = None,
                        select: Callable[[str], bool] | None = None) -> None:
        if self._nothing_to_copy():  # nothing to copy, and nothing raised
            return
        # harbor reads the reward files whole: copied apart, bounded (see _reward).
        await download_with_rewards(
            self._require_sandbox().open_root, source_dir, Path(target_dir),
            self._options.transfer_limits,
            rewards=PurePosixPath(source_dir) == EnvironmentPaths.verifier_dir,
            warn=self.logger.warning, exclude=exclude, select=select)


def _job_sources(config_path: Path) -> list[Path]:
    """The dataset and task directories a harbor job's ``config.json`` names (local
    paths and download directories), read through harbor's own model; none when there
    is no such file."""
    try:
        config = JobConfig.model_validate_json(config_path.read_bytes())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as error:
        logging.getLogger(__name__).warning(
            "the job's %s cannot be read (%s); its other tasks stay visible to its trials "
            "unless they lie beside this one", config_path, error)
        return []
    sources = [*config.datasets, *config.tasks]
    return [Path(value).absolute() for source in sources
            for value in (source.path, source.download_dir) if value is not None]
