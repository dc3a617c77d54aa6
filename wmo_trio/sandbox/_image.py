"""Building a task's Dockerfile into a cached layer, on the host's userland.

``FROM`` is not pulled: the host's system directories stand in for every base image
(see :mod:`wmo_trio.sandbox._rootfs`). The other instructions are carried out in a
sandbox whose writes land in one directory: ``RUN`` runs there with the package
registries reachable, ``COPY``/``ADD`` unpack build-context files, here-documents and
files of an earlier stage (built in a sandbox of its own) there, and ``ENV``,
``ARG``, ``WORKDIR``, ``USER``, ``SHELL``, ``ENTRYPOINT`` and ``CMD`` are recorded as
the image's configuration. The result is cached under the hash of the Dockerfile, its
build context, the build arguments and the host's layers, and reused by every trial of
the task; the first trial builds it while the others wait on the image's lock file.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import glob
import hashlib
import io
import json
import logging
import os
import posixpath
import re
import shlex
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from wmo_trio.sandbox._dockerfile import (
    DockerfileError,
    Instruction,
    Stage,
    assignments,
    build_plan,
    expand,
    read,
)
from wmo_trio.sandbox._hostfs import (
    FileTooLarge,
    read_beneath,
    remove_beneath,
    remove_or_set_aside,
    remove_tree,
    tree_size,
)
from wmo_trio.sandbox._namespace import (
    DEFAULT_PATH,
    Sandbox,
    StateDir,
    remove_stale_states,
    same_file,
)
from wmo_trio.sandbox._processes import Channel, Completed, SpawnFailed, wait_readable
from wmo_trio.sandbox._rootfs import HostLayers, prune_host_layers

__all__ = ["BuildError", "Image", "ImageCache", "ImageConfig", "Pruned", "default_cache_dir"]

FORMAT_VERSION = 1
LOCK_POLL_SEC = 0.05
# A RUN's script longer than this is read from a file: the kernel refuses a single
# argument over MAX_ARG_STRLEN (32 pages).
LONG_ARGUMENT = 96 << 10
SCRIPT_PLACEHOLDER = "\0script\0"  # where a RUN's command names its script's file
# Written into a build's /etc so that RUN reaches the registries; not part of the image.
NETWORK_ETC_FILES = {"resolv.conf": "nameserver 10.0.2.3\n"}
# What one COPY --from may bring out of an earlier stage. The stage's own tar writes
# that stream, and the stage is the task's: it passes through the host only this far.
STAGE_COPY_LIMIT = 2 << 30


class BuildError(RuntimeError):
    """A Dockerfile step failed; the message names the step and shows its last output."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "wmo-trio" / "sandbox"


# The system's CA bundle. Tools that ship their own roots (uv) are pointed at it, so they
# trust what apt, curl and pip trust here: a host's egress proxy may re-sign TLS with a CA
# only the host's store knows.
SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def base_env() -> dict[str, str]:
    """The environment every image starts from, before its Dockerfile's ``ENV``."""
    # Base images set PATH, so ENV PATH="/x:${PATH}" extends it.
    env = {"PATH": DEFAULT_PATH}
    if os.path.isfile(SYSTEM_CA_BUNDLE):
        env["SSL_CERT_FILE"] = SYSTEM_CA_BUNDLE
    return env


@dataclass
class ImageConfig:
    env: dict[str, str] = field(default_factory=base_env)
    workdir: str | None = None
    user: str | None = None
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    shell: list[str] = field(default_factory=lambda: ["/bin/sh", "-c"])


@dataclass(frozen=True)
class Image:
    key: str
    layer: Path
    config: ImageConfig
    lock_fd: int  # held shared while a trial uses the image, so prune leaves it alone
    has_sudo: bool = False

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


@dataclass(frozen=True)
class CachedImage:
    key: str
    path: Path
    task: str
    size_bytes: int
    built_at: float
    in_use: bool
    # Who built it, for a cache every user of the machine shares: the system user, and
    # the task directory and job directory of the trial that built it ("" before these
    # were recorded).
    user: str = ""
    task_dir: str = ""
    job: str = ""


def _user() -> str:
    """This process's user's name (its uid where the system knows no name)."""
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


@dataclass(frozen=True)
class Pruned:
    """What a prune removed, and what it kept because a trial or a build (of any job,
    in any process) holds it."""

    removed: list[CachedImage] = field(default_factory=list)
    images_in_use: list[CachedImage] = field(default_factory=list)
    layers_removed: list[Path] = field(default_factory=list)
    layers_in_use: list[Path] = field(default_factory=list)


def _context_digest(context: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(context.rglob("*")):
        info = path.lstat()
        digest.update(f"{path.relative_to(context)}\0{info.st_mode:o}\0".encode())
        if path.is_file() and not path.is_symlink():
            with path.open("rb") as handle:
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
        elif path.is_symlink():
            digest.update(os.readlink(path).encode())
    return digest.hexdigest()


def image_key(context: Path, build_args: Mapping[str, str], host: HostLayers) -> str:
    status = Path("/var/lib/dpkg/status")
    host_state = status.stat().st_mtime_ns if status.exists() else 0
    # The builder's own source is part of the key: a change to how images are built
    # must not reuse images built the old way.
    builder = b"".join(Path(__file__).with_name(name).read_bytes()
                       for name in ("_image.py", "_dockerfile.py"))
    # The host's layout, never what this job hides: that names the job's own directory.
    material = json.dumps([FORMAT_VERSION, hashlib.sha256(builder).hexdigest(),
                           sorted(build_args.items()), host.identity,
                           host_state, _context_digest(context)])
    return hashlib.sha256(material.encode()).hexdigest()[:24]


async def _lock(fd: int, mode: int) -> None:
    """flock without blocking the loop; cancellable while it waits."""
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            await asyncio.sleep(LOCK_POLL_SEC)


class ImageCache:
    """Built images under ``root/images/<key>/`` (``layer/`` and ``image.json``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.images = root / "images"

    async def ensure(
        self,
        context: Path,
        host: HostLayers,
        *,
        task_name: str,
        build_args: Mapping[str, str],
        build_timeout_sec: float | None,
        log: Any = None,
        notice: Callable[[str], None] | None = None,
        built_for: Mapping[str, str] | None = None,
    ) -> Image:
        """The task's image, built now if no trial built it before (its record says for
        whom: `built_for`, the trial's task and job directories). Holds the image's
        lock shared until :meth:`Image.release`. Raises :class:`DockerfileError` for a
        Dockerfile that cannot be built here, :class:`BuildError` for a failed step."""
        plan = build_plan(read(context / "Dockerfile"), build_args)
        key = await asyncio.to_thread(image_key, context, build_args, host)
        target = self.images / key
        lock_path = self.images / f"{key}.lock"
        self.images.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                await _lock(fd, fcntl.LOCK_SH)
                if not (target / "image.json").is_file():
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    await _lock(fd, fcntl.LOCK_EX)
                # A cleaner removes the lock file of an image nobody built or uses; a
                # lock taken on the file it removed guards nothing.
                if not same_file(fd, lock_path):
                    os.close(fd)
                    continue
                if not (target / "image.json").is_file():
                    for stage in plan:
                        text = await asyncio.to_thread(stand_in_notice, stage.base)
                        if text is not None and notice is not None:
                            notice(text)
                    async with asyncio.timeout(build_timeout_sec):
                        await self._build(plan, context, host, target, task_name,
                                          build_args, log, built_for or {})
                fcntl.flock(fd, fcntl.LOCK_SH)
                meta = json.loads((target / "image.json").read_text())
                os.utime(target / "image.json")  # last use, for prune --older-than
                return Image(key=key, layer=target / "layer", config=ImageConfig(**meta["config"]),
                             lock_fd=fd, has_sudo=bool(meta.get("has_sudo")))
            except BaseException:
                os.close(fd)
                raise

    def remove_leftovers(self) -> None:
        """Remove what builds whose process died left: their directories (a staged
        image included) and the lock files of images they never built. Safe while
        other processes build or use images: those hold their locks."""
        remove_stale_states(self.root / "builds")
        for lock_path in self.images.glob("*.lock"):
            image = lock_path.with_suffix("")
            if (image / "image.json").is_file():
                continue
            try:
                fd = os.open(lock_path, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if same_file(fd, lock_path) and not (image / "image.json").is_file():
                    lock_path.unlink()
            except BlockingIOError:
                pass
            finally:
                os.close(fd)

    async def _build(self, plan: list[Stage], context: Path, host: HostLayers,
                     target: Path, task_name: str, build_args: Mapping[str, str],
                     log: Any, built_for: Mapping[str, str]) -> None:
        """Build each stage of the plan in a sandbox of its own; the stages the last one
        copies from run until it is built, and only its layer is kept."""
        states: list[StateDir] = []
        sandboxes: list[Sandbox] = []
        sources: dict[int, Channel] = {}
        started = time.time()
        try:
            for stage in plan:
                state = await asyncio.to_thread(StateDir.create, self.root / "builds",
                                                f"{target.name}-{stage.index}")
                states.append(state)
                sandbox = await Sandbox.launch(state=state, host=host, image_layer=None,
                                               network=True, hostname="build",
                                               etc_files=NETWORK_ETC_FILES)
                sandboxes.append(sandbox)
                builder = _Builder(sandbox.channel, context, build_args, log, sources,
                                   stage.global_args)
                for instruction in stage.instructions:
                    await builder.step(instruction)
                sources[stage.index] = sandbox.channel
            record = {"task": task_name, "built_at": started, "seconds": time.time() - started,
                      "config": asdict(builder.config), "has_sudo": await builder.has_sudo(),
                      "built_by": {"user": _user(), **built_for}}
            for sandbox in sandboxes:
                await sandbox.stop()
            await asyncio.to_thread(_drop_network_files, sandboxes[-1].upper)
            await asyncio.to_thread(_commit, states[-1], sandboxes[-1].upper, target, record)
        finally:
            for sandbox in sandboxes:
                await sandbox.stop()
            for state in states:
                await asyncio.to_thread(state.remove)

    def entries(self) -> list[CachedImage]:
        found = []
        for path in sorted(self.images.glob("*/image.json")):
            image = path.parent
            try:
                meta = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            try:
                size = tree_size(image)  # a build may have left any tree there
            except OSError:
                size = 0
            by = meta.get("built_by") if isinstance(meta.get("built_by"), dict) else {}
            found.append(CachedImage(key=image.name, path=image, task=str(meta.get("task", "")),
                                     size_bytes=size, built_at=path.stat().st_mtime,
                                     in_use=self._in_use(image.name),
                                     user=str(by.get("user", "")),
                                     task_dir=str(by.get("task", "")), job=str(by.get("job", ""))))
        return found

    def _in_use(self, key: str) -> bool:
        try:
            fd = os.open(self.images / f"{key}.lock", os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def prune(self, older_than_sec: float | None = None) -> Pruned:
        """Remove images no trial uses (last used before ``older_than_sec`` ago, when
        given), the host's layers no trial or build holds, and leftovers of interrupted
        builds; what was removed and what was kept in use."""
        pruned = Pruned()
        self.remove_leftovers()
        for leftover in self.images.glob(".new-*"):  # staged by earlier versions
            remove_tree(leftover)
        for image in self.entries():
            if older_than_sec is not None and time.time() - image.built_at < older_than_sec:
                continue
            fd = os.open(self.images / f"{image.key}.lock", os.O_RDWR)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pruned.images_in_use.append(image)
                    continue
                remove_or_set_aside(image.path, logging.getLogger(__name__))
                (self.images / f"{image.key}.lock").unlink(missing_ok=True)
                pruned.removed.append(image)
            finally:
                os.close(fd)
        layers_removed, layers_in_use = prune_host_layers(self.root)
        pruned.layers_removed.extend(layers_removed)
        pruned.layers_in_use.extend(layers_in_use)
        return pruned


def _drop_network_files(upper: Path) -> None:
    """Remove the build's own network files from its layer, unless a step replaced
    them. The build wrote that directory: nothing there is followed or read unbounded
    (a ``resolv.conf`` linked to ``/proc/kmsg`` would block a plain read for good)."""
    for name, text in NETWORK_ETC_FILES.items():
        relative = f"etc/{name}"
        try:
            written = read_beneath(upper, relative, limit=len(text.encode()))
        except FileTooLarge:
            continue
        if written == text.encode():
            remove_beneath(upper, relative)


def _commit(state: StateDir, layer: Path, target: Path, record: dict[str, Any]) -> None:
    """Move a finished build's layer and its record into place at once. They are put
    together in the build's own directory, so a build killed meanwhile leaves them
    where its other leftovers are removed."""
    staging = state.path / "image"
    staging.mkdir()
    layer.rename(staging / "layer")
    (staging / "image.json").write_text(json.dumps(record, indent=2))
    if target.exists():
        remove_or_set_aside(target, logging.getLogger(__name__))
    staging.rename(target)


# Official language images by name, and the Debian package of the host that stands in
# for each, with what to call it.
LANGUAGE_IMAGES = {
    "python": ("python3", "Python"),
    "pypy": ("python3", "Python"),
    "node": ("nodejs", "Node.js"),
    "golang": ("golang-go", "Go"),
    "rust": ("rustc", "Rust"),
    "ruby": ("ruby", "Ruby"),
}


# Where Docker's official images ("library") are served under a registry's name: Docker
# Hub's own hosts, where the library is also the default namespace, and the public
# mirrors of it that tasks name to avoid Docker Hub's pull limits (terminal-bench 2's
# tasks use the last two).
DOCKER_HUB_HOSTS = ("docker.io/", "index.docker.io/", "registry-1.docker.io/",
                    "registry.hub.docker.com/")
LIBRARY_MIRRORS = ("public.ecr.aws/docker/library/", "mirror.gcr.io/library/")


def official_library_name(base: str) -> str | None:
    """The name and tag of the official image ``base`` names (``python:3.13`` for
    ``python:3.13``, ``docker.io/library/python:3.13`` or
    ``public.ecr.aws/docker/library/python:3.13``), digest dropped; None for any other
    image."""
    name = base.split("@")[0]
    for mirror in LIBRARY_MIRRORS:
        if name.startswith(mirror):
            name = name.removeprefix(mirror)
            break
    else:
        for host in DOCKER_HUB_HOSTS:
            name = name.removeprefix(host)
        name = name.removeprefix("library/")
    return None if "/" in name or not name else name


@functools.cache
def host_packages() -> dict[str, str]:
    """The host's installed Debian packages and their versions (epoch dropped)."""
    found: dict[str, str] = {}
    try:
        text = Path("/var/lib/dpkg/status").read_text(errors="replace")
    except OSError:
        return found
    for entry in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in entry.splitlines()
                      if ": " in line and not line.startswith(" "))
        if "installed" in fields.get("Status", "") and "Package" in fields:
            found[fields["Package"]] = fields.get("Version", "").partition(":")[2] or \
                fields.get("Version", "")
    return found


def stand_in_notice(base: str, packages: Mapping[str, str] | None = None) -> str | None:
    """One line saying that the host cannot supply the language version a ``FROM``
    image names, and what stands in for it; None when it can (or the image is not an
    official language image)."""
    name = official_library_name(base)
    if name is None:
        return None
    image, _, tag = name.partition(":")
    if image not in LANGUAGE_IMAGES:
        return None
    package, language = LANGUAGE_IMAGES[image]
    wanted = re.match(r"\d+(?:\.\d+)*", tag)
    version = (host_packages() if packages is None else packages).get(package)
    if version is None:
        have = f"this host has no {language}"
    else:
        have_match = re.match(r"\d+(?:\.\d+)*", version)
        have_version = have_match.group(0) if have_match else version
        if wanted is None or (have_version + ".").startswith(wanted.group(0) + "."):
            return None
        have = f"the host's {language} {have_version} stands in for it"
    return (f"FROM {base}: the docker-free environment does not pull images and {have}; "
            "use harbor's docker, podman or singularity environment for the exact image")


class _Builder:
    """Carries out one stage's instructions in a build sandbox."""

    def __init__(self, channel: Channel, context: Path, build_args: Mapping[str, str],
                 log: Any, stages: Mapping[int, Channel] | None = None,
                 global_args: Mapping[str, str] | None = None) -> None:
        self.channel = channel
        self.global_args = dict(global_args or {})
        self.stages = dict(stages or {})  # built stages a COPY --from reads, by index
        self.context = context.resolve()
        self.build_args = dict(build_args)
        self.args: dict[str, str] = {}
        self.config = ImageConfig()
        self.log = log

    @property
    def variables(self) -> dict[str, str]:
        return {**self.args, **self.config.env}

    def _env(self) -> dict[str, str]:
        return {"PATH": DEFAULT_PATH, **self.args, **self.config.env}

    async def _run(self, instruction: Instruction, argv: list[str], *, user: str | None,
                   cwd: str, stdin: int | None = None) -> str:
        """Run a command of a step; its stdout on success, a BuildError otherwise."""
        try:
            completed = await self.channel.run(argv, env=self._env(), cwd=cwd, user=user,
                                               stdin=stdin, output_limit=256 << 10)
        except SpawnFailed as error:
            raise BuildError(f"Dockerfile {instruction.describe()} failed: {error}") from None
        output = completed.stdout.decode(errors="replace") + completed.stderr.decode(errors="replace")
        if self.log is not None:
            self.log.write(f"# {instruction.describe()}\n{output}")
            self.log.flush()
        if completed.return_code != 0:
            tail = "\n".join(output.strip().splitlines()[-15:])
            raise BuildError(f"Dockerfile {instruction.describe()} failed with exit code "
                             f"{completed.return_code}:\n{tail}")
        return completed.stdout.decode(errors="replace")

    @property
    def workdir(self) -> str:
        return self.config.workdir or "/"

    async def step(self, instruction: Instruction) -> None:
        keyword = instruction.keyword
        if keyword == "ARG":
            for name, default in assignments(instruction, self.variables):
                value = self.build_args.get(name, self.global_args.get(name) if default is None
                                            else default)
                if value is not None:
                    self.args[name] = value
        elif keyword == "ENV":
            for name, value in assignments(instruction, self.variables):
                self.config.env[name] = value or ""
        elif keyword == "WORKDIR":
            path = expand(instruction.argument.strip().strip("\"'"), self.variables)
            self.config.workdir = posixpath.normpath(posixpath.join(self.workdir, path))
            # As BuildKit does, a WORKDIR made now belongs to the current USER.
            script = ('[ -d "$1" ] && exit 0; mkdir -p -- "$1" || exit 1; '
                      '[ -z "$2" ] || chown -- "$2" "$1"')
            await self._run(instruction, ["sh", "-c", script, "sh", self.config.workdir,
                                          self.config.user or ""], user=None, cwd="/")
        elif keyword == "USER":
            self.config.user = expand(instruction.argument.strip(), self.variables) or None
        elif keyword == "SHELL":
            shell = instruction.json_list()
            if not shell:
                raise DockerfileError(f"{instruction.describe()}: SHELL needs a JSON array")
            self.config.shell = shell
        elif keyword in ("ENTRYPOINT", "CMD"):
            command = instruction.json_list()
            if command is None:
                command = [*self.config.shell, instruction.argument]
            if keyword == "ENTRYPOINT":
                self.config.entrypoint = command or None
                self.config.cmd = None  # Docker resets CMD with a new ENTRYPOINT
            else:
                self.config.cmd = command
        elif keyword == "RUN":
            await self._run_step(instruction)
            await self._end_step_processes()
        elif keyword in ("COPY", "ADD"):
            await self._copy(instruction)

    def _run_argv(self, instruction: Instruction) -> tuple[list[str], str | None]:
        """A RUN's command, and the text of a script it runs from a file (named
        SCRIPT_PLACEHOLDER in the command) or None.

        As BuildKit does: a RUN that is one here-document runs it as its script (a
        ``#!`` line picks the interpreter); otherwise the shell gets the line with each
        document after it, so every body feeds the command its marker follows, and the
        shell expands (or, quoted, keeps) what it holds. A script too long for one
        argument (the kernel refuses one over MAX_ARG_STRLEN) is read from a file."""
        exec_form = instruction.json_list()
        if exec_form is not None and not instruction.heredocs:
            return exec_form, None
        script = instruction.argument
        documents = instruction.heredocs
        if len(documents) == 1 and script.strip() == documents[0].marker:
            script = documents[0].content
            if script.startswith("#!"):
                return [SCRIPT_PLACEHOLDER], script
        elif documents:
            script = script + "\n" + "".join(document.script for document in documents)
        if len(script.encode()) > LONG_ARGUMENT:
            return [*self.config.shell, f". {SCRIPT_PLACEHOLDER}"], script
        return [*self.config.shell, script], None

    async def _run_step(self, instruction: Instruction) -> None:
        argv, script = self._run_argv(instruction)
        if script is None:
            await self._run(instruction, argv, user=self.config.user, cwd=self.workdir)
            return
        path = f"/tmp/.wmo-trio-run-{uuid.uuid4().hex}"
        with tempfile.TemporaryFile() as text:
            text.write(script.encode())
            text.seek(0)
            await self._run(instruction, ["sh", "-c", 'mkdir -p /tmp && cat > "$1" && '
                                          'chmod 755 "$1"', "sh", path],
                            user=None, cwd="/", stdin=text.fileno())
        try:
            await self._run(instruction, [word.replace(SCRIPT_PLACEHOLDER, path) for word in argv],
                            user=self.config.user, cwd=self.workdir)
        finally:
            await self.channel.run(["rm", "-f", "--", path], env=self._env(), cwd="/")

    async def _end_step_processes(self) -> None:
        """End every process the step left running, however it detached (``setsid``,
        ``nohup``, a double fork, a cleared environment): under Docker each step runs
        in a container of its own, so a daemon a step starts is gone at the next."""
        await self.channel.end_others()

    async def has_sudo(self) -> bool:
        """Whether the image has a ``sudo`` on its PATH."""
        probe = await self.channel.run(["sh", "-c", "command -v sudo"], env=self._env(), cwd="/")
        return probe.return_code == 0

    async def _owner(self, instruction: Instruction) -> tuple[int, int] | None:
        spec = expand(instruction.flags.get("chown", ""), self.variables)
        if not spec:
            return None
        user, _, group = spec.partition(":")
        script = ('u=$1; g=$2; uid=$(id -u -- "$u") || exit 1; '
                  'if [ -z "$g" ]; then gid=$(id -g -- "$u"); '
                  'else case $g in *[!0-9]*) gid=$(getent group "$g" | cut -d: -f3);; '
                  '*) gid=$g;; esac; fi; [ -n "$gid" ] || { echo "no group $g" >&2; exit 1; }; '
                  'echo "$uid $gid"')
        if user.isdigit() and (not group or group.isdigit()):
            return int(user), int(group or user)
        output = await self._run(instruction, ["sh", "-c", script, "sh", user, group],
                                 user=None, cwd="/")
        uid, gid = output.split()
        return int(uid), int(gid)

    def _sources(self, instruction: Instruction, patterns: list[str]) -> list[Path]:
        sources: list[Path] = []
        for pattern in patterns:
            if "://" in pattern:
                raise DockerfileError(f"{instruction.describe()}: {instruction.keyword} from a "
                                      "URL is not supported by the docker-free environment")
            matches = sorted(glob.glob(str(self.context / pattern.lstrip("/")))) or []
            if not matches:
                raise BuildError(f"Dockerfile {instruction.describe()} failed: {pattern} is not "
                                 "in the build context (the task's environment directory)")
            for match in matches:
                path = Path(match).resolve()
                if path != self.context and self.context not in path.parents:
                    raise BuildError(f"Dockerfile {instruction.describe()} failed: {pattern} "
                                     "lies outside the build context")
                sources.append(Path(match))
        return sources

    async def _copy(self, instruction: Instruction) -> None:
        words = instruction.json_list()
        if words is None:
            try:
                words = shlex.split(instruction.argument)
            except ValueError as error:
                raise DockerfileError(f"{instruction.describe()}: {error}") from None
        words = [expand(word, self.variables) for word in words]
        documents = [(document.name, (document.content if document.quoted
                                      else expand(document.content, self.variables)).encode())
                     for document in instruction.heredocs]
        if not words or len(words) + len(documents) < 2:
            raise DockerfileError(f"{instruction.describe()}: needs a source and a destination")
        *patterns, destination = words
        stage = instruction.flags.get("from")
        sources: list[Path] = []
        picked: list[tuple[str, bool]] = []  # (path in the stage, is a directory)
        if stage is not None:
            picked = await self._stage_matches(instruction, int(stage), patterns)
        else:
            sources = self._sources(instruction, patterns)
        destination = posixpath.join(self.workdir, destination)
        count = len(sources) + len(picked) + len(documents)
        as_directory = (destination.endswith("/") or count > 1
                        or any(source.is_dir() for source in sources)
                        or any(is_dir for _, is_dir in picked))
        if not as_directory:
            probe = await self.channel.run(["test", "-d", destination], env=self._env(), cwd="/")
            as_directory = probe.return_code == 0
        destination = posixpath.normpath(destination)
        owner = await self._owner(instruction)
        mode = instruction.flags.get("chmod")
        chmod = int(mode, 8) if mode else None
        archives = [s for s in sources if instruction.keyword == "ADD" and s.is_file()
                    and tarfile.is_tarfile(s)]
        with contextlib.ExitStack() as stack:
            parts = []
            for path, is_dir in picked:
                part = stack.enter_context(tempfile.TemporaryFile())
                await self._stage_archive(instruction, int(stage or 0), path, is_dir, part)
                parts.append((path, is_dir, part))
            bundle = stack.enter_context(tempfile.TemporaryFile())
            await asyncio.to_thread(_pack, bundle, [s for s in sources if s not in archives],
                                    destination, as_directory, owner, chmod, documents, parts)
            bundle.seek(0)
            await self._run(instruction, ["tar", "-x", "-p", "--numeric-owner",
                                          "--no-overwrite-dir", "-f", "-", "-C", "/"],
                            user=None, cwd="/", stdin=bundle.fileno())
        for archive in archives:
            with archive.open("rb") as handle:
                await self._run(instruction, ["sh", "-c", 'mkdir -p -- "$1" && exec tar -x -f - -C "$1"',
                                              "sh", destination], user=None, cwd="/",
                                stdin=handle.fileno())

    async def _stage_matches(self, instruction: Instruction, stage: int,
                             patterns: list[str]) -> list[tuple[str, bool]]:
        """What the patterns of a ``COPY --from`` match in that stage's filesystem
        (paths from its root, as BuildKit reads them), each with whether it is a
        directory."""
        script = ('cd / || exit 1; IFS="\n"; for p; do found=; for m in ${p#/}; do '
                  'if [ -e "$m" ] || [ -L "$m" ]; then found=1; '
                  'if [ -d "$m" ] && [ ! -L "$m" ]; then echo "d $m"; else echo "f $m"; fi; fi; '
                  'done; [ -n "$found" ] || { echo "$p: no such file or directory" >&2; exit 2; }; '
                  'done')
        completed = await self._in_stage(instruction, stage, ["sh", "-c", script, "sh", *patterns])
        found = []
        for line in completed.stdout.decode(errors="surrogateescape").splitlines():
            kind, _, path = line.partition(" ")
            found.append(("/" + path.lstrip("/"), kind == "d"))
        return found

    async def _stage_archive(self, instruction: Instruction, stage: int, path: str,
                             is_dir: bool, into: Any) -> None:
        """A tar of a path of an earlier stage: a directory's contents, or the file."""
        parent, name = posixpath.split(path)
        argv = (["tar", "-c", "-f", "-", "-C", path, "."] if is_dir
                else ["tar", "-c", "-f", "-", "-C", parent or "/", "--", name])
        read_end, write_end = os.pipe()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(_bounded_copy(read_end, into, STAGE_COPY_LIMIT, lambda: (
                    f"Dockerfile {instruction.describe()} failed: {path} in stage {stage} "
                    f"holds more than {STAGE_COPY_LIMIT >> 20} MiB")))
                try:
                    await self._in_stage(instruction, stage, argv, stdout=write_end)
                finally:  # the copy ends at the end of the stream
                    os.close(write_end)
                    write_end = -1
        except BaseExceptionGroup as group_error:
            raise group_error.exceptions[0] from None
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
        into.seek(0)

    async def _in_stage(self, instruction: Instruction, stage: int, argv: list[str],
                        stdout: Any = None) -> Completed:
        channel = self.stages[stage]
        try:
            completed = await channel.run(argv, env={"PATH": DEFAULT_PATH}, cwd="/", stdout=stdout)
        except SpawnFailed as error:
            raise BuildError(f"Dockerfile {instruction.describe()} failed: {error}") from None
        if completed.return_code != 0:
            detail = completed.stderr.decode(errors="replace").strip()[-2000:]
            raise BuildError(f"Dockerfile {instruction.describe()} failed: stage {stage}: "
                             f"{detail or f'exit code {completed.return_code}'}")
        return completed


async def _bounded_copy(fd: int, into: Any, limit: int, too_much: Callable[[], str]) -> None:
    """Copy a pipe into a file until its end, refusing (``BuildError``) past ``limit``
    bytes."""
    os.set_blocking(fd, False)
    copied = 0
    while True:
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            await wait_readable(fd)
            continue
        if not chunk:
            return
        copied += len(chunk)
        if copied > limit:
            raise BuildError(too_much())
        await asyncio.to_thread(into.write, chunk)


def _pack(bundle: Any, sources: list[Path], destination: str, as_directory: bool,
          owner: tuple[int, int] | None, chmod: int | None,
          documents: Sequence[tuple[str, bytes]] = (),
          parts: Sequence[tuple[str, bool, Any]] = ()) -> None:
    """A tar of what a COPY places, as it places it: build-context files, here-documents
    and tars of an earlier stage's paths, owned by ``owner`` (context files and
    documents by root if None; a stage's files keep theirs)."""

    def placed(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid, info.gid = owner or (0, 0)
        info.uname = info.gname = ""
        if chmod is not None and not info.issym():
            info.mode = chmod
        return info

    def restaged(info: tarfile.TarInfo) -> tarfile.TarInfo:
        if owner is not None:
            return placed(info)
        info.uname = info.gname = ""
        if chmod is not None and not info.issym():
            info.mode = chmod
        return info

    with tarfile.open(fileobj=bundle, mode="w", format=tarfile.PAX_FORMAT) as tar:
        base = destination.lstrip("/")
        if as_directory and base:
            info = tarfile.TarInfo(base)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
            tar.addfile(placed(info) if owner else info)
        for source in sources:
            if source.is_dir() and not source.is_symlink():
                for path in sorted(source.rglob("*")):
                    name = posixpath.join(base, path.relative_to(source).as_posix())
                    tar.add(path, arcname=name, recursive=False, filter=placed)
            else:
                name = posixpath.join(base, source.name) if as_directory else base
                tar.add(source, arcname=name, recursive=False, filter=placed)
        for document, content in documents:
            info = tarfile.TarInfo(posixpath.join(base, document) if as_directory else base)
            info.size, info.mode, info.mtime = len(content), 0o644, int(time.time())
            tar.addfile(placed(info), io.BytesIO(content))
        for picked, is_dir, part in parts:
            _restage(tar, part, base, posixpath.basename(picked), is_dir, as_directory, restaged)


def _restage(tar: tarfile.TarFile, part: Any, base: str, name: str, is_dir: bool,
             as_directory: bool, placed: Any) -> None:
    """Copy the members of a stage's tar into ``tar`` under their new names. Only
    headers and bytes pass through the host; nothing is written to its filesystem."""
    if is_dir:
        top = base
    else:
        top = posixpath.join(base, name) if as_directory else base

    def renamed(member: str) -> str:
        relative = posixpath.normpath(member)
        if is_dir:
            return top if relative == "." else posixpath.join(top, relative)
        return top

    with tarfile.open(fileobj=part, mode="r:") as archive:
        for member in archive:
            if is_dir and posixpath.normpath(member.name) == ".":
                continue  # the destination directory itself is made by the COPY
            if member.name.startswith("/") or ".." in member.name.split("/"):
                continue
            member.name = renamed(member.name)
            if member.islnk():
                member.linkname = renamed(member.linkname)
            placed(member)
            if member.isreg():
                tar.addfile(member, archive.extractfile(member))
            else:
                tar.addfile(member)
