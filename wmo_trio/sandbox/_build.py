"""Building a task's Dockerfile, stage by stage, each in a sandbox of its own.

``FROM`` is not pulled: the host's system directories stand in for every base image
(see ``_rootfs``, and ``_stand_in`` for what the build says about it). The other
instructions are carried out in a build sandbox whose writes land in one directory, its
upper directory: ``RUN`` runs there with the package registries reachable, and ends
with every process it started, however it detached (under Docker each step is a
container of its own); ``COPY``/``ADD`` unpack what ``_packing`` packs there; ``ENV``,
``ARG``, ``WORKDIR``, ``USER``, ``SHELL``, ``ENTRYPOINT`` and ``CMD`` are recorded as
the image's configuration. The stages a ``COPY --from`` reads run until the last one is
built; the last one's upper directory is the image's layer, which the cache
(``_image``) takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import glob
import os
import posixpath
import shlex
import tarfile
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from wmo_trio.sandbox._dockerfile import Instruction, assignments, expand
from wmo_trio.sandbox._dockerfile import Stage as PlannedStage
from wmo_trio.sandbox._errors import BuildError, DockerfileError, FileTooLarge, SpawnFailed
from wmo_trio.sandbox._hostfs import read_beneath, remove_beneath
from wmo_trio.sandbox._namespace import Sandbox
from wmo_trio.sandbox._network import RESOLV_CONF
from wmo_trio.sandbox._overlay import SandboxRoot
from wmo_trio.sandbox._packing import Picked, Placement, Stage, pack
from wmo_trio.sandbox._processes import Channel
from wmo_trio.sandbox._profile import DEFAULT_PATH
from wmo_trio.sandbox._rootfs import HostLayers
from wmo_trio.sandbox._state import StateDir
from wmo_trio.sandbox._threads import made_in_thread

__all__ = ["BuiltLayer", "ImageConfig", "building"]

# A RUN's script longer than this is read from a file: the kernel refuses a single
# argument over MAX_ARG_STRLEN (32 pages).
LONG_ARGUMENT = 96 << 10
SCRIPT_PLACEHOLDER = "\0script\0"  # where a RUN's command names its script's file
# Written into a build's /etc so that RUN reaches the registries; not part of the image.
NETWORK_ETC_FILES = {"resolv.conf": RESOLV_CONF}
# Each step's output kept a stream, for its log and its error.
STEP_OUTPUT_LIMIT = 256 << 10


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
class BuiltLayer:
    """A finished build: its layer (the last stage's upper directory, its sandbox
    stopped), a place to stage it beside the layer in the build's own directory, and
    the image's configuration."""

    layer: Path
    staging: Path
    config: ImageConfig
    has_sudo: bool


@contextlib.asynccontextmanager
async def building(plan: Sequence[PlannedStage], context: Path, host: HostLayers,
                   builds: Path, name: str, build_args: Mapping[str, str],
                   log: IO[str] | None) -> AsyncIterator[BuiltLayer]:
    """Build each stage of ``plan`` in a sandbox of its own, its directory in
    ``builds``; the block gets the finished layer, and its directories go when it ends.
    Raises :class:`BuildError` for a step that failed, :class:`DockerfileError` for one
    that cannot be carried out here."""
    sources: dict[int, Channel] = {}
    root = SandboxRoot(host, etc_files=NETWORK_ETC_FILES)
    async with contextlib.AsyncExitStack() as states:
        async with contextlib.AsyncExitStack() as sandboxes:
            for stage in plan:
                state = await made_in_thread(functools.partial(
                    StateDir.create, builds, f"{name}-{stage.index}"), StateDir.close)
                await states.enter_async_context(state)
                sandbox = await sandboxes.enter_async_context(await Sandbox.launch(
                    state, root, hostname="build", network=True))
                builder = _Builder(sandbox.channel, context, build_args, log, sources,
                                   stage.global_args)
                for instruction in stage.instructions:
                    await builder.step(instruction)
                sources[stage.index] = sandbox.channel
            has_sudo = await builder.has_sudo()
        # Every stage's sandbox is gone: the last one's upper directory is the layer.
        await asyncio.to_thread(_drop_network_files, sandbox.upper)
        yield BuiltLayer(sandbox.upper, state.path / "image", builder.config, has_sudo)


class _Builder:
    """Carries out one stage's instructions in a build sandbox."""

    def __init__(self, channel: Channel, context: Path, build_args: Mapping[str, str],
                 log: IO[str] | None, stages: Mapping[int, Channel] | None = None,
                 global_args: Mapping[str, str] | None = None) -> None:
        self.channel = channel
        self.global_args = dict(global_args or {})
        self.stages = dict(stages or {})  # built stages a COPY --from reads, by index
        self.context = context.resolve()
        self.build_args = dict(build_args)
        self.args: dict[str, str] = {}
        self.config = ImageConfig()
        self.log = log
        # What each instruction does; the others change nothing a trial sees.
        self._steps: dict[str, Callable[[Instruction], Awaitable[None]]] = {
            "ARG": self._arg, "ENV": self._env_step, "WORKDIR": self._workdir,
            "USER": self._user, "SHELL": self._shell, "ENTRYPOINT": self._entrypoint,
            "CMD": self._cmd, "RUN": self._run_step, "COPY": self._copy, "ADD": self._copy,
        }

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
                                               stdin=stdin, output_limit=STEP_OUTPUT_LIMIT)
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
        carry_out = self._steps.get(instruction.keyword)
        if carry_out is not None:
            await carry_out(instruction)

    async def _arg(self, instruction: Instruction) -> None:
        for name, default in assignments(instruction, self.variables):
            value = self.build_args.get(name, self.global_args.get(name) if default is None
                                        else default)
            if value is not None:
                self.args[name] = value

    async def _env_step(self, instruction: Instruction) -> None:
        for name, value in assignments(instruction, self.variables):
            self.config.env[name] = value or ""

    async def _workdir(self, instruction: Instruction) -> None:
        path = expand(instruction.argument.strip().strip("\"'"), self.variables)
        self.config.workdir = posixpath.normpath(posixpath.join(self.workdir, path))
        # As BuildKit does, a WORKDIR made now belongs to the current USER.
        script = ('[ -d "$1" ] && exit 0; mkdir -p -- "$1" || exit 1; '
                  '[ -z "$2" ] || chown -- "$2" "$1"')
        await self._run(instruction, ["sh", "-c", script, "sh", self.config.workdir,
                                      self.config.user or ""], user=None, cwd="/")

    async def _user(self, instruction: Instruction) -> None:
        self.config.user = expand(instruction.argument.strip(), self.variables) or None

    async def _shell(self, instruction: Instruction) -> None:
        shell = instruction.json_list()
        if not shell:
            raise DockerfileError(f"{instruction.describe()}: SHELL needs a JSON array")
        self.config.shell = shell

    def _command(self, instruction: Instruction) -> list[str]:
        """An ENTRYPOINT's or CMD's command: its exec form, or its line for the shell."""
        command = instruction.json_list()
        return [*self.config.shell, instruction.argument] if command is None else command

    async def _entrypoint(self, instruction: Instruction) -> None:
        self.config.entrypoint = self._command(instruction) or None
        self.config.cmd = None  # Docker resets CMD with a new ENTRYPOINT

    async def _cmd(self, instruction: Instruction) -> None:
        self.config.cmd = self._command(instruction)

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
        else:
            await self._run_script(instruction, argv, script)
        await self._end_step_processes()

    async def _run_script(self, instruction: Instruction, argv: list[str], script: str) -> None:
        """Run a RUN whose script is read from a file, written first into the build."""
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
        stage = None
        sources: list[Path] = []
        picked: list[Picked] = []
        if "from" in instruction.flags:
            index = int(instruction.flags["from"])
            stage = Stage(index, self.stages[index], instruction)
            picked = await stage.matches(patterns)
        else:
            sources = self._sources(instruction, patterns)
        destination = posixpath.join(self.workdir, destination)
        count = len(sources) + len(picked) + len(documents)
        as_directory = (destination.endswith("/") or count > 1
                        or any(source.is_dir() for source in sources)
                        or any(one.is_dir for one in picked))
        if not as_directory:
            probe = await self.channel.run(["test", "-d", destination], env=self._env(), cwd="/")
            as_directory = probe.return_code == 0
        destination = posixpath.normpath(destination)
        mode = instruction.flags.get("chmod")
        placement = Placement(await self._owner(instruction), int(mode, 8) if mode else None)
        archives = [s for s in sources if instruction.keyword == "ADD" and s.is_file()
                    and tarfile.is_tarfile(s)]
        with contextlib.ExitStack() as stack:
            parts = []
            for one in picked:
                assert stage is not None
                part = stack.enter_context(tempfile.TemporaryFile())
                await stage.archive(one, part)
                parts.append((one, part))
            bundle = stack.enter_context(tempfile.TemporaryFile())
            await asyncio.to_thread(pack, bundle, [s for s in sources if s not in archives],
                                    destination, as_directory, placement, documents, parts)
            bundle.seek(0)
            await self._run(instruction, ["tar", "-x", "-p", "--numeric-owner",
                                          "--no-overwrite-dir", "-f", "-", "-C", "/"],
                            user=None, cwd="/", stdin=bundle.fileno())
        for archive in archives:
            with archive.open("rb") as handle:
                await self._run(instruction, ["sh", "-c", 'mkdir -p -- "$1" && exec tar -x -f - -C "$1"',
                                              "sh", destination], user=None, cwd="/",
                                stdin=handle.fileno())


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
