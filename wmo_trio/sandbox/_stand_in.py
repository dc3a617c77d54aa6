"""What stands in for a Dockerfile's ``FROM``: the host's userland, whatever image it
names. Where ``FROM`` names an official language image (``python:3.12-slim``,
``docker.io/library/node:22``, a public mirror of Docker's official library) whose
version the host's packages do not have, the build says so in one line, naming what
stands in.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["official_library_name", "stand_in_notice"]


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
