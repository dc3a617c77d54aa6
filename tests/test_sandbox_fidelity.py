"""The docker-free environment builds Dockerfiles as BuildKit does (here-documents,
``COPY --from`` a stage), says in one line what it cannot do (an image's language
version, sudo for a non-root USER, automatic host mounts), and a trial whose build
failed leaves one line, not a traceback."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
from test_local_environment import (
    REPO,
    TASKS,
    make_environment,
    pytestmark,
    run,
    run_harbor,
    running,
    trial_results,
)

from wmo_trio.sandbox import BuildError, DockerfileError, _packing
from wmo_trio.sandbox._dockerfile import build_plan, parse
from wmo_trio.sandbox._environment import AUTO_MOUNTING_REFUSED, COMPOSE_REFUSED
from wmo_trio.sandbox._rootfs import MAN_DB_AUTO_UPDATE
from wmo_trio.sandbox._stand_in import stand_in_notice

__all__ = ["pytestmark"]

def outputs_in(tmp_path: Path, dockerfile: str, *commands: str) -> list[str]:
    """What each command prints (stdout and stderr) in a trial of the image built from
    ``dockerfile``."""
    context = tmp_path / "environment"
    context.mkdir(exist_ok=True)
    (context / "Dockerfile").write_text(textwrap.dedent(dockerfile).replace("\\t", "\t"))
    outputs: list[str] = []

    async def scenario() -> None:
        environment = make_environment(tmp_path, context, cache_dir=str(tmp_path / "cache"))
        async with running(environment):
            for command in commands:
                result = await environment.exec(command)
                outputs.append((result.stdout or "") + (result.stderr or ""))

    run(scenario)
    return outputs


# ---------------------------------------------------------------------- here-documents


def test_a_heredoc_feeds_the_command_its_marker_follows(tmp_path: Path) -> None:
    assert outputs_in(tmp_path, """\
        FROM debian:bookworm-slim
        RUN cat > /usr/local/bin/tool <<'EOF' && chmod +x /usr/local/bin/tool
        #!/bin/sh
        echo "tool says $1"
        EOF
        """, "tool x") == ["tool says x\n"]


def test_an_unquoted_heredoc_expands_build_args_and_env_and_a_quoted_one_keeps_its_text(
    tmp_path: Path,
) -> None:
    assert outputs_in(tmp_path, """\
        FROM debian:bookworm-slim
        ARG GREETING=hello
        ENV WHO=world
        RUN cat > /expanded <<EOF
        $GREETING $WHO
        EOF
        RUN cat > /literal <<'EOF'
        $GREETING $WHO
        EOF
        """, "cat /expanded", "cat /literal") == ["hello world\n", "$GREETING $WHO\n"]


def test_a_dash_heredoc_drops_leading_tabs_and_two_heredocs_feed_their_own_commands(
    tmp_path: Path,
) -> None:
    assert outputs_in(tmp_path, """\
        FROM debian:bookworm-slim
        RUN <<-EOF cat > /tabs && <<SECOND cat > /second
        \tindented
        \tEOF
        second
        SECOND
        """, "cat /tabs", "cat /second") == ["indented\n", "second\n"]


def test_a_run_that_is_one_heredoc_runs_it_with_its_shebang_or_the_shell(
    tmp_path: Path,
) -> None:
    assert outputs_in(tmp_path, """\
        FROM debian:bookworm-slim
        RUN <<EOF
        #!/usr/bin/env python3
        open("/from-python", "w").write("python ran\\n")
        EOF
        RUN <<EOF
        echo shell ran > /from-shell
        EOF
        """, "cat /from-python", "cat /from-shell") == ["python ran\n", "shell ran\n"]


def test_a_heredoc_too_long_for_one_argument_still_builds(tmp_path: Path) -> None:
    body = "\n".join(f"line {n} " + "x" * 100 for n in range(1500))  # over 128 KiB
    dockerfile = (f"FROM debian:bookworm-slim\nRUN cat > /big <<'EOF'\n{body}\nEOF\n"
                  f"RUN <<EOF\n: '{body}'\necho ran > /script-ran\nEOF\n")
    assert outputs_in(tmp_path, dockerfile, "wc -l < /big; cat /script-ran; ls /tmp") == [
        "1500\nran\n"]


def test_copy_writes_heredocs_as_files(tmp_path: Path) -> None:
    assert outputs_in(tmp_path, """\
        FROM debian:bookworm-slim
        ENV WHO=world
        COPY <<EOF /copied
        copied $WHO
        EOF
        COPY <<'EOF' <<two.txt /docs/
        literal $WHO
        EOF
        second document
        two.txt
        """, "cat /copied", "cat /docs/EOF /docs/two.txt") == [
        "copied world\n", "literal $WHO\nsecond document\n"]


def test_an_unterminated_heredoc_is_one_error_naming_its_line() -> None:
    with pytest.raises(DockerfileError, match="line 2: the here-document EOF never ends"):
        parse("FROM debian\nRUN cat > /x <<EOF\nbody\n")


def test_a_heredoc_marker_inside_quotes_exec_form_or_a_word_is_text() -> None:
    [_, quoted, exec_form, shift, here_string] = parse(
        "FROM debian\nRUN echo '<<EOF'\nRUN [\"echo\", \"<<EOF\"]\nRUN echo $((1<<4))\n"
        "RUN cat <<<word\n")
    assert quoted.heredocs == exec_form.heredocs == shift.heredocs == here_string.heredocs == ()


# ---------------------------------------------------------------------- COPY --from


def test_copy_from_a_named_stage_or_an_index_keeps_owners_and_links(tmp_path: Path) -> None:
    assert outputs_in(tmp_path, """\
        FROM debian:bookworm-slim AS builder
        RUN mkdir -p /out/sub && echo built > /out/sub/file.txt \\
            && ln -s file.txt /out/sub/link && chown -R 1234:1234 /out
        RUN echo first-stage > /marker

        FROM debian:bookworm-slim
        COPY --from=builder /out /from-stage
        COPY --from=0 /marker /marker-by-index
        """, "stat -c '%n %u:%g %F' /from-stage/sub/file.txt /from-stage/sub/link",
        "cat /marker-by-index /from-stage/sub/link") == [
        "/from-stage/sub/file.txt 1234:1234 regular file\n"
        "/from-stage/sub/link 1234:1234 symbolic link\n", "first-stage\nbuilt\n"]


def test_copy_from_a_stage_expands_globs_and_applies_chown(tmp_path: Path) -> None:
    assert outputs_in(tmp_path, """\
        FROM debian:bookworm-slim AS build
        RUN mkdir -p /src/lib && echo a > /src/lib/a.so && echo b > /src/lib/b.so
        FROM debian:bookworm-slim
        RUN useradd -u 4321 agent
        COPY --from=build --chown=agent:agent /src/lib/*.so /usr/local/lib/mine/
        """, "stat -c '%n %u' /usr/local/lib/mine/a.so /usr/local/lib/mine/b.so") == [
        "/usr/local/lib/mine/a.so 4321\n/usr/local/lib/mine/b.so 4321\n"]



def test_copy_from_a_stage_brings_out_no_more_than_its_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage is the task's, and so is the ``tar`` that packs what COPY --from takes:
    one that never stops writing is cut off at the limit, the build failing in one line,
    instead of filling the host's disk until the build's time runs out."""
    monkeypatch.setattr(_packing, "STAGE_COPY_LIMIT", 1 << 20)
    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text(textwrap.dedent("""\
        FROM debian:bookworm-slim AS builder
        RUN printf '#!/bin/sh\\nexec cat /dev/zero\\n' > /usr/local/bin/tar \\
            && chmod +x /usr/local/bin/tar
        FROM debian:bookworm-slim
        COPY --from=builder /etc/hostname /copied
        """))

    async def scenario() -> None:
        environment = make_environment(tmp_path, context, cache_dir=str(tmp_path / "cache"))
        with pytest.raises(BuildError, match=r"/etc/hostname in stage 0 holds more than 1 MiB"):
            async with running(environment):
                pass

    run(scenario)

def test_a_bare_arg_in_a_stage_takes_the_default_declared_before_from(tmp_path: Path) -> None:
    assert outputs_in(tmp_path, """\
        ARG SUITE=bookworm
        ARG TOOL_VERSION=1.2.3
        FROM debian:${SUITE}-slim
        ARG TOOL_VERSION
        RUN echo "$TOOL_VERSION" > /version
        """, "cat /version") == ["1.2.3\n"]


def test_only_the_stages_the_image_needs_are_built() -> None:
    plan = build_plan(parse("FROM debian AS unused\nRUN exit 1\nFROM debian AS tools\n"
                            "FROM debian\nCOPY --from=tools /bin/sh /sh\n"), {})
    assert [stage.index for stage in plan] == [1, 2]
    assert plan[-1].instructions[0].flags["from"] == "1"


def test_copy_from_an_image_is_one_error_naming_it() -> None:
    with pytest.raises(DockerfileError, match=r"line 2: .*--from=nginx:1\.27 names an image"):
        build_plan(parse("FROM debian\nCOPY --from=nginx:1.27 /etc/nginx /etc/nginx\n"), {})


def test_copy_from_a_later_stage_is_refused() -> None:
    with pytest.raises(DockerfileError, match="must name a stage defined before"):
        build_plan(parse("FROM debian AS first\nCOPY --from=1 /x /x\nFROM debian\n"
                         "COPY --from=first /x /x\n"), {})


@pytest.mark.skipif(not os.path.lexists(MAN_DB_AUTO_UPDATE), reason="the host has no man-db")
def test_an_installed_package_leaves_no_manual_page_index_to_rebuild(tmp_path: Path) -> None:
    """As in the images the host stands in for, which have no man-db: its trigger on the
    host's would rebuild the index after each package a build or trial installs."""
    assert outputs_in(tmp_path, "FROM debian:bookworm-slim\n",
                      f"test -e {MAN_DB_AUTO_UPDATE} || echo absent") == ["absent\n"]


# Prints the `sleep 9876xx` processes alive, by command line, once there are at least as
# many as its argument (a minute at most: a daemon's exec may lag its start).
LIVE_DAEMONS = """\
import glob, sys, time
deadline = time.monotonic() + 60
while True:
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            line = open(path, "rb").read()
        except OSError:
            continue
        if line.startswith(b"sleep\\x009876"):
            found.append(line.split(b"\\x00")[1].decode())
    if len(found) >= int(sys.argv[1]) or time.monotonic() > deadline:
        print(sorted(found))
        break
    time.sleep(0.01)
"""


def test_no_process_a_run_step_started_is_alive_in_the_next_step(tmp_path: Path) -> None:
    """As under Docker, where each step is a container of its own: daemons however
    detached (setsid, nohup, a double fork, setsid with a cleared environment)."""
    (tmp_path / "environment").mkdir()
    (tmp_path / "environment" / "daemons.py").write_text(LIVE_DAEMONS)
    assert outputs_in(tmp_path, """\
        FROM debian:bookworm-slim
        COPY daemons.py /daemons.py
        RUN setsid -f sleep 987601; nohup sleep 987602 >/dev/null 2>&1 & \\
            (sleep 987603 </dev/null >/dev/null 2>&1 &); \\
            env -i setsid -f sh -c '(sleep 987604 &)' </dev/null >/dev/null 2>&1; \\
            python3 /daemons.py 4 > /started
        RUN python3 /daemons.py 0 > /left
        """, "cat /started /left") == ["['987601', '987602', '987603', '987604']\n[]\n"]


# ---------------------------------------------------------------------- what the host lacks


def test_a_language_version_the_host_lacks_is_named_with_its_stand_in() -> None:
    host = {"python3": "3.11.2-1+b1", "nodejs": "20.19.0-1nodesource1"}
    python = stand_in_notice("python:3.12-slim", host)
    assert python is not None and "python:3.12-slim" in python and "Python 3.11.2" in python
    node = stand_in_notice("docker.io/library/node:22", host)
    assert node is not None and "Node.js 20.19.0" in node
    golang = stand_in_notice("golang:1.24", host)
    assert golang is not None and "no Go" in golang and "podman or singularity" in golang
    assert stand_in_notice("python:3.11-slim", host) is None
    assert stand_in_notice("python:3", host) is None
    assert stand_in_notice("ubuntu:24.04", host) is None


@pytest.mark.parametrize("base", [
    "public.ecr.aws/docker/library/node:22", "mirror.gcr.io/library/node:22-slim",
    "index.docker.io/library/node:22", "registry-1.docker.io/node:22@sha256:" + "0" * 64,
])
def test_an_official_image_behind_a_mirror_of_dockers_library_is_named_as_the_library(
    base: str,
) -> None:
    notice = stand_in_notice(base, {"nodejs": "20.19.0-1nodesource1"})
    assert notice is not None and f"FROM {base}:" in notice and "Node.js 20.19.0" in notice


@pytest.mark.parametrize("base", [
    "public.ecr.aws/someone/node:22", "mirror.gcr.io/someone/node:22", "ghcr.io/library/node:22",
    "quay.io/node:22",
])
def test_an_image_of_another_namespace_or_registry_is_not_taken_for_the_library(
    base: str,
) -> None:
    assert stand_in_notice(base, {"nodejs": "20.19.0-1nodesource1"}) is None


def warnings_of_a_start(tmp_path: Path, dockerfile: str, caplog: Any) -> list[str]:
    """The warnings logged while a trial of ``dockerfile``'s image starts and stops."""
    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text(dockerfile)

    async def scenario() -> None:
        environment = make_environment(tmp_path, context, cache_dir=str(tmp_path / "cache"))
        async with running(environment):
            pass

    with caplog.at_level(logging.WARNING):
        run(scenario)
    return [record.getMessage() for record in caplog.records]


def test_the_build_says_which_image_the_host_stands_in_for(
    tmp_path: Path, caplog: Any
) -> None:
    # No host has this interpreter as its python3.
    said = warnings_of_a_start(tmp_path, "FROM python:2.7-slim\nWORKDIR /app\n", caplog)
    notices = [text for text in said if "python:2.7-slim" in text]
    assert len(notices) == 1 and "stands in for it" in notices[0], said


def test_an_image_with_sudo_and_a_non_root_user_is_told_sudo_cannot_work(
    tmp_path: Path, caplog: Any
) -> None:
    said = warnings_of_a_start(tmp_path, (
        "FROM debian:bookworm-slim\n"
        "RUN printf '#!/bin/sh\\nexec \"$@\"\\n' > /usr/local/bin/sudo && chmod 755 /usr/local/bin/sudo\n"
        "RUN useradd -m agent\nUSER agent\n"), caplog)
    about_sudo = [text for text in said if "sudo" in text]
    assert len(about_sudo) == 1 and "USER agent" in about_sudo[0], said
    assert "no_new_privs" in about_sudo[0]


# ---------------------------------------------------------------------- harbor's CLI


@pytest.mark.harbor
def test_a_failed_build_leaves_one_line_for_the_log_download_not_a_traceback(
    tmp_path: Path,
) -> None:
    task = tmp_path / "broken-build"
    shutil.copytree(TASKS / "hello-file", task)
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nRUN exit 3\n")
    completed = run_harbor(tmp_path / "jobs", "-p", str(task), "-a", "oracle",
                           "--ek", f"cache_dir={tmp_path / 'cache'}", timeout=300)
    [result] = trial_results(tmp_path / "jobs").values()
    assert result["exception_info"]["exception_type"] == "BuildError"
    output = completed.stdout + completed.stderr
    assert "Traceback" not in output, output
    assert "did not start" in output


def test_a_compose_task_is_refused_as_the_docs_say_and_the_job_goes_on(
    tmp_path: Path,
) -> None:
    """Its trial fails in one line; before, the refusal ended the whole job in harbor's
    266-line traceback and the other task's trial was lost."""
    shutil.copytree(TASKS / "hello-file", tmp_path / "tasks" / "hello-file")
    compose = tmp_path / "tasks" / "compose-one"
    shutil.copytree(TASKS / "hello-file", compose)
    (compose / "environment" / "docker-compose.yaml").write_text(
        "services:\n  main:\n    build: .\n")
    completed = run_harbor(tmp_path / "jobs", "-p", str(tmp_path / "tasks"), "-a", "oracle",
                           "-n", "2", "--ek", f"state_dir={tmp_path / 'state'}", timeout=300)
    assert completed.returncode == 0, completed.stderr
    output = completed.stdout + completed.stderr
    assert "Traceback" not in output, output
    results = {result["task_name"]: result for result in trial_results(tmp_path / "jobs").values()}
    assert results["compose-one"]["exception_info"]["exception_message"] == COMPOSE_REFUSED
    assert results["hello-file"]["verifier_result"]["rewards"]["reward"] == 1.0
    docs = " ".join((REPO / "docs" / "sandbox.md").read_text().split())
    assert COMPOSE_REFUSED in docs
    assert "Docker Compose tasks are refused" in docs


def test_a_stopped_sandbox_has_nothing_to_copy_out_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """harbor asks for the logs of a trial whose start was cancelled halfway, after the
    sandbox is gone: one line, not an error with its traceback."""
    environment = make_environment(tmp_path)

    async def scenario() -> None:
        async with running(environment):
            pass
        await environment.download_dir("/logs/agent", tmp_path / "agent")
        await environment.download_file("/logs/agent/x", tmp_path / "x")

    with caplog.at_level(logging.WARNING):
        run(scenario)
    said = [r.getMessage() for r in caplog.records if "nothing to copy out" in r.getMessage()]
    assert said == [f"nothing to copy out of {environment.session_id}: its environment has "
                    "stopped"]
    assert not (tmp_path / "x").exists()


@pytest.mark.harbor
def test_auto_mounting_is_refused_in_one_line_and_no_trial_runs(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    completed = run_harbor(tmp_path / "jobs", "-p", str(TASKS), "-a", "oracle", "-n", "2",
                           "--ek", "auto_mounting=true", "--ek", f"state_dir={state_dir}",
                           timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert completed.stderr.splitlines() == [AUTO_MOUNTING_REFUSED]
    results = trial_results(tmp_path / "jobs")
    assert len(results) == 3
    for result in results.values():
        assert result["exception_info"]["exception_message"] == AUTO_MOUNTING_REFUSED
    assert not state_dir.exists()  # no sandbox was made
    for trial in (tmp_path / "jobs" / "job").glob("*/"):
        for directory in (trial, trial / "agent", trial / "verifier", trial / "artifacts"):
            assert directory.stat().st_mode & 0o002 == 0, directory  # not world-writable


def test_the_environment_refuses_auto_mounting_and_says_it_mounts_nothing(
    tmp_path: Path,
) -> None:
    assert "\n" not in AUTO_MOUNTING_REFUSED
    environment = make_environment(tmp_path, auto_mounting=True)
    # harbor never sees the option, so it leaves the trial's host directories as they are
    assert environment.auto_mounting is False
    assert environment.capabilities.mounted is False
    with pytest.raises(ValueError) as raised:
        run(lambda: environment.start(force_build=False))
    assert str(raised.value) == AUTO_MOUNTING_REFUSED
    assert not (tmp_path / "state").exists()


def test_a_bind_mount_asked_for_is_never_read_through_by_harbor(tmp_path: Path) -> None:
    """A user's --mounts bind still binds, but harbor is told the path is not mounted, so
    it copies the trial's files out rather than reading what the trial left there."""
    shared = tmp_path / "shared"
    shared.mkdir()
    environment = make_environment(
        tmp_path, mounts=[{"type": "bind", "source": str(shared), "target": "/logs/verifier"}])

    async def scenario() -> None:
        async with running(environment):
            written = await environment.exec("echo 1 > /logs/verifier/reward.txt")
            assert written.return_code == 0
        assert not environment.is_path_mounted(Path("/logs/verifier"), shared)

    asyncio.run(scenario())
    assert (shared / "reward.txt").read_text() == "1\n"


def test_the_entrypoint_ends_with_the_trial_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A container's main process ends when the container stops; the pubtasks run logged
    "the ENTRYPOINT failed" at the stop of every task with one."""
    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text(
        'FROM ubuntu:24.04\nENTRYPOINT ["sh", "-c", "echo up > /tmp/up; exec \\"$@\\"", "sh"]\n')
    environment = make_environment(tmp_path, context, cache_dir=str(tmp_path / "cache"))

    async def scenario() -> None:
        async with running(environment):
            # The ENTRYPOINT runs beside the trial's commands: one waits until it has.
            waited = await environment.exec("until [ -e /tmp/up ]; do sleep 0.05; done")
            assert waited.return_code == 0

    with caplog.at_level(logging.DEBUG, logger=environment.logger.name):
        run(scenario)
    messages = [record.getMessage() for record in caplog.records]
    assert not [m for m in messages if "ENTRYPOINT failed" in m], messages
    assert any("the ENTRYPOINT ended with the trial" in m for m in messages), messages
