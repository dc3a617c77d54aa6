"""The Dockerfile's reading, apart from any build: here-documents and their markers,
the stages an image needs and what `COPY --from` may name, and the notice that names the
image a host stands in for. Pure functions: no sandbox, no root, not slow."""

from __future__ import annotations

import pytest

from wmo_trio.sandbox import DockerfileError
from wmo_trio.sandbox._dockerfile import build_plan, parse
from wmo_trio.sandbox._stand_in import stand_in_notice


def test_an_unterminated_heredoc_is_one_error_naming_its_line() -> None:
    with pytest.raises(DockerfileError, match="line 2: the here-document EOF never ends"):
        parse("FROM debian\nRUN cat > /x <<EOF\nbody\n")


def test_a_heredoc_marker_inside_quotes_exec_form_or_a_word_is_text() -> None:
    [_, quoted, exec_form, shift, here_string] = parse(
        "FROM debian\nRUN echo '<<EOF'\nRUN [\"echo\", \"<<EOF\"]\nRUN echo $((1<<4))\n"
        "RUN cat <<<word\n")
    assert quoted.heredocs == exec_form.heredocs == shift.heredocs == here_string.heredocs == ()


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

