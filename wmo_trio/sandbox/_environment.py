"""``LocalEnvironment``: harbor's environment interface over a sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hashlib
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
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

from wmo_trio.sandbox import _storage, _transfer
from wmo_trio.sandbox._cgroup import Limits, host_cgroups, remove_stale_cgroups
from wmo_trio.sandbox._dockerfile import DockerfileError
from wmo_trio.sandbox._hostfs import remove_tree
from wmo_trio.sandbox._image import Image, ImageCache, ImageConfig, default_cache_dir
from wmo_trio.sandbox._namespace import (
    DEFAULT_PATH,
    Bind,
    Sandbox,
    StateDir,
    default_state_root,
    missing_tools,
    remove_stale_states,
    unavailable,
)
from wmo_trio.sandbox._processes import ChannelClosed, SpawnFailed
from wmo_trio.sandbox._reward import download_reward_files, excluding_rewards
from wmo_trio.sandbox._rootfs import HostLayers, host_layers

__all__ = ["LocalEnvironment"]

ENTRYPOINT_LOG = "sandbox-entrypoint.log"
# How much of each of the ENTRYPOINT's streams its log keeps: a service that floods
# its output must not fill the jobs directory.
ENTRYPOINT_LOG_LIMIT = 4 << 20
BUILD_LOG = "sandbox-build.log"
# What harbor's Docker environment runs as the container's command; an ENTRYPOINT
# receives it as its arguments.
KEEPALIVE = ["sh", "-c", "sleep infinity"]
# A trial's processes (threads count) when the job does not say: far above what builds
# and test suites use, and a fork bomb in each of several concurrent trials still leaves
# the host's PIDs (32,768 by default) to the host.
DEFAULT_PIDS_LIMIT = 1024
DEFAULT_SHM_SIZE_MB = 64  # Docker's
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
        self._transfer_limits = _transfer.TransferLimits(
            max_bytes=int(_positive("download_limit_mb", download_limit_mb,
                                    _transfer.DEFAULT_DOWNLOAD_LIMIT_MB) * (1 << 20)),
            timeout_sec=_positive("download_timeout_sec", download_timeout_sec,
                                  _transfer.DEFAULT_DOWNLOAD_TIMEOUT_SEC),
        )
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
        self._state_root = Path(state_dir) if state_dir else default_state_root()
        self._cache = ImageCache(Path(cache_dir) if cache_dir else default_cache_dir())
        if isinstance(build_args, str):
            build_args = json.loads(build_args)
        if build_args is not None and not (
            isinstance(build_args, Mapping)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in build_args.items())
        ):
            raise ValueError("build_args must be a JSON object of strings, e.g. '{\"V\": \"1\"}'")
        self._build_args = dict(build_args or {})
        self._pids_limit = _count("pids_limit", pids_limit, minimum=0, zero="no cap")
        self._shm_size_mb = _count("shm_size_mb", shm_size_mb, minimum=1)
        self._sandbox: Sandbox | None = None
        self._started = False  # a sandbox ran, whether or not it still does
        self._said_not_started = False
        self._image: Image | None = None
        self._host: HostLayers | None = None  # held (leased) from start to stop
        self._config = ImageConfig()
        self._shell = "sh"
        self._entrypoint_task: asyncio.Task[None] | None = None
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

    def _limits(self) -> tuple[Limits, int | None]:
        """The trial's ceilings as harbor resolves them (task.toml's ``cpus`` and
        ``memory_mb``, overrides, the enforcement policy) and ``pids_limit``, and the
        bytes its writes may take (``storage_mb``, see ``_storage``); those this machine
        cannot enforce are dropped, with one warning per task."""
        cpus = self._resource_limit_value("cpu", auto_mode=ResourceMode.LIMIT)
        memory_mb = self._resource_limit_value("memory", auto_mode=ResourceMode.LIMIT)
        pids = self._pids_limit or None
        cgroups = host_cgroups()
        unenforced = []
        if cpus is not None and not cgroups.offers("cpu"):
            unenforced.append(f"cpus={cpus}")
            cpus = None
        if memory_mb is not None and not cgroups.offers("memory"):
            unenforced.append(f"memory_mb={memory_mb}")
            memory_mb = None
        if pids is not None and not cgroups.offers("pids"):
            unenforced.append(f"pids_limit={pids}")
            pids = None
        reasons = [cgroups.reason] if unenforced else []
        storage_mb = self._effective_storage_mb
        if storage_mb is not None and not storage_mb > 0:
            raise ValueError(f"storage_mb must be a positive number of MiB, not {storage_mb!r}")
        problem = None if storage_mb is None else _storage.problem()
        if problem is not None:
            unenforced.append(f"storage_mb={storage_mb}")
            reasons.append(f"{problem}, so a trial's writes go to the state directory's "
                           "filesystem without a bound")
            storage_mb = None
        if unenforced and self.environment_name not in _WARNED_UNENFORCED:
            _WARNED_UNENFORCED.add(self.environment_name)
            self.logger.warning("%s: %s not enforced: %s", self.environment_name,
                                " and ".join(unenforced), "; ".join(map(str, reasons)))
        return (Limits(cpus=None if cpus is None else float(cpus), memory_mb=memory_mb,
                       pids=pids), None if storage_mb is None else storage_mb << 20)

    def _shm_bytes(self, limits: Limits) -> int:
        """``/dev/shm``'s size: what it holds counts against memory_mb, and a trial
        that fills it past that leaves nothing for its processes."""
        size = self._shm_size_mb << 20
        if limits.memory_mb is not None:
            size = min(size, limits.memory_mb << 19)
        return size

    @classmethod
    def preflight(cls) -> None:
        """Fail the job early, before any trial is queued, if no trial could start."""
        reason = missing_tools()
        if reason is not None:
            raise SystemExit(str(unavailable(reason)))

    def _validate_definition(self) -> None:
        if (self.environment_dir / "docker-compose.yaml").exists():
            raise ValueError(
                "LocalEnvironment does not run Docker Compose task environments; "
                "use harbor's Docker environment (-e docker)."
            )
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
                 task_dir.parent, job_dir, job_dir.parent, self._state_root,
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
        finding = asyncio.ensure_future(asyncio.to_thread(self._sweep_and_find_layers))
        try:
            host = await asyncio.shield(finding)
        except asyncio.CancelledError:  # the thread goes on: its lease is let go after it
            finding.add_done_callback(_release_found)
            raise
        image: Image | None = None
        state: StateDir | None = None
        try:
            if (self.environment_dir / "Dockerfile").is_file():
                if force_build:
                    self.logger.debug("force_build: the cached image is reused; prune the "
                                      "cache (wmo-trio sandbox prune) to rebuild it")
                image = await self._build_image(host)
                self._config = image.config
                self._warn_about_sudo(image)
            elif self.task_env_config.docker_image:
                self.logger.debug("docker_image %s: the host's userland stands in for it",
                                  self.task_env_config.docker_image)
            state, binds = await asyncio.to_thread(self._state_and_binds)
            hostname = hashlib.sha256(self.session_id.encode()).hexdigest()[:12]
            etc = {"hostname": f"{hostname}\n",
                   "hosts": f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                            f"127.0.1.1\t{hostname}\n"}
            if self._network:
                etc["resolv.conf"] = "nameserver 10.0.2.3\n"
            limits, storage_bytes = self._limits()
            self._sandbox = await Sandbox.launch(
                state=state, host=host, image_layer=image.layer if image else None,
                network=self._network, hostname=hostname, binds=binds, etc_files=etc,
                limits=limits, shm_bytes=self._shm_bytes(limits), storage_bytes=storage_bytes,
            )
            self._image, self._host = image, host
            self._started = True
            await self._prepare()
        except BaseException:
            sandbox, self._sandbox = self._sandbox, None
            if sandbox is not None:
                await sandbox.stop()
            if state is not None:
                await asyncio.to_thread(state.remove)
            if image is not None:
                image.release()
            host.release()
            self._image = self._host = None
            raise
        await self._upload_environment_dir_after_start()

    def _sweep_and_find_layers(self) -> HostLayers:
        """Remove what dead processes left (sandboxes' directories and cgroups, builds'
        leftovers: here, not only before a build, or they would outlive every job whose
        images are all built); the host's layers. One thread for all: each hop to a
        thread costs the start a wait for the loop."""
        remove_stale_states(self._state_root)
        remove_stale_cgroups()
        self._cache.remove_leftovers()
        if self._effective_storage_mb is not None:
            _storage.problem()  # found once per process, here rather than on the loop
        return host_layers(self._cache.root, self._hidden_paths())

    def _state_and_binds(self) -> tuple[StateDir, list[Bind]]:
        state = StateDir.create(self._state_root, self.session_id)
        try:
            return state, self._binds()
        except BaseException:
            state.remove()
            raise

    async def _build_image(self, host: Any) -> Image:
        log_path = self.trial_paths.trial_dir / BUILD_LOG
        log = await asyncio.to_thread(log_path.open, "w")
        with log:
            try:
                return await self._cache.ensure(
                    self.environment_dir, host, task_name=self.environment_name,
                    build_args=self._build_args,
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

    async def _prepare(self) -> None:
        """Create the working directory and world-writable mount targets (as Docker's
        start does), pick the shell, start the ENTRYPOINT."""
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
            self._entrypoint_task = asyncio.get_running_loop().create_task(
                self._run_entrypoint(argv, log)
            )

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
        except Exception as error:  # the trial goes on, as a container whose main process died
            self.logger.warning("the ENTRYPOINT failed: %s", error)

    async def stop(self, delete: bool) -> None:
        """End every process of the trial; remove its upper directories unless
        ``delete`` is false, in which case they are kept for inspection. Once it
        returns, no process of the trial runs; the directories go in a thread of their
        own meanwhile, which this process waits for at its exit
        (``wmo_trio.sandbox._namespace.wait_for_removals``).

        Safe to call twice or without ``start``.
        """
        sandbox, self._sandbox = self._sandbox, None
        image, self._image = self._image, None
        host, self._host = self._host, None
        if sandbox is None:
            if host is not None:
                host.release()
            return
        try:
            await sandbox.stop(linger=delete)
            task, self._entrypoint_task = self._entrypoint_task, None
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if delete:
                # There too: slirp4netns's exit, and the overlays' unmounting before
                # their directories go.
                sandbox.state.remove_later(first=sandbox.finish)
            else:
                kept = await asyncio.to_thread(_keep, sandbox.state)
                self.logger.info("Kept the trial's filesystem changes in %s", kept)
        finally:
            if sandbox.unfinished and not sandbox.state.removing:
                # A stop that failed: nothing is left behind (off the loop: it waits).
                await asyncio.to_thread(sandbox.finish)
            if image is not None:
                image.release()
            if host is not None:
                host.release()

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
        await _transfer.upload_file(self._require_sandbox().open_root, Path(source_path),
                                    target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """Copy a host directory's contents into ``target_dir`` (created if needed),
        owned by root, modes kept."""
        await _transfer.upload_dir(self._require_sandbox().open_root, Path(source_dir),
                                   target_dir)

    def _never_started(self) -> bool:
        """Whether there is nothing to copy out because the trial never started (its
        build failed): said in one line for the trial, since harbor logs a raised error
        with its traceback and the build's."""
        if self._sandbox is not None or self._started:
            return False
        if not self._said_not_started and self._refusal is None:
            self.logger.warning("nothing to copy out of %s: its environment did not start",
                                self.session_id)
        self._said_not_started = True
        return True

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        """Copy a file out of the trial (within the download limits); the host copy
        belongs to harbor's user. Nothing is copied (and nothing raised) when the trial
        never started."""
        if self._never_started():
            return
        await _transfer.download_file(self._require_sandbox().open_root, source_path,
                                      Path(target_path), self._transfer_limits)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Copy a directory's contents out of the trial into ``target_dir``: what fits
        the download limits, then ``TransferIncomplete`` if anything was left out."""
        await self._download(source_dir, target_dir)

    async def download_dir_with_exclusions(self, *, source_dir: str, target_dir: Path | str,
                                           exclude: list[str]) -> None:
        """``download_dir`` without the entries ``exclude`` matches (as tar's
        ``--exclude`` does: any trailing part of a path, a directory with its contents)."""
        await self._download(source_dir, target_dir,
                             exclude=lambda path: _tar_excluded(path, exclude))

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
                        **options: Any) -> None:
        if self._never_started():  # nothing to copy, and nothing raised
            return
        # harbor reads the reward files whole: copied apart, bounded (see _reward).
        rewards = dict(options) if PurePosixPath(source_dir) == EnvironmentPaths.verifier_dir \
            else None
        if rewards is not None:
            options["exclude"] = excluding_rewards(options.get("exclude"))
        outcome = await _transfer.download_dir(self._require_sandbox().open_root, source_dir,
                                               Path(target_dir), self._transfer_limits,
                                               **options)
        if rewards is not None:
            for said in await download_reward_files(self._require_sandbox().open_root,
                                                    source_dir, Path(target_dir), **rewards):
                self.logger.warning(said)
        warning = outcome.warning()
        if warning is not None:
            self.logger.warning(warning)
        outcome.check()


def _release_found(finding: asyncio.Future[HostLayers]) -> None:
    if not finding.cancelled() and finding.exception() is None:
        finding.result().release()


def _positive(name: str, value: float | str | None, default: float) -> float:
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0 or number == float("inf"):
        raise ValueError(f"{name} must be a positive number, not {value!r}")
    return number


def _tar_excluded(path: str, patterns: Sequence[str]) -> bool:
    parts = path.split("/")
    return any(fnmatch.fnmatchcase("/".join(parts[index:]), pattern.strip("/"))
               for index in range(len(parts)) for pattern in patterns)


def _count(name: str, value: object, *, minimum: int, zero: str = "") -> int:
    """A whole-number environment kwarg (harbor's ``--ek`` passes text or JSON)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        meaning = f" ({minimum}: {zero})" if zero else ""
        raise ValueError(f"{name} must be a whole number >= {minimum}{meaning}, "
                         f"not {value!r}")
    return value


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


def _keep(state: StateDir) -> Path:
    """Keep a stopped trial's upper directories as ``kept-<name>/`` beside the others,
    out of reach of the stale-state cleanup, and drop the rest; where they are (with
    storage_mb, the filesystem image whose ``upper/`` they are)."""
    kept = state.path.with_name("kept-" + state.path.name)
    for scratch in ("work", "root", "hidden", "launch.log", _storage.TOP):
        remove_tree(state.path / scratch)
    os.rename(state.path, kept)
    state.path = kept
    with contextlib.suppress(FileNotFoundError):
        state.lock_path.unlink()
    os.close(state.lock_fd)
    return kept / _storage.IMAGE if (kept / _storage.IMAGE).exists() else kept
