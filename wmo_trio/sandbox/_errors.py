"""The sandbox's errors, in one place. Each message says what went wrong and what to do.

- :class:`SandboxUnavailableError`: this machine cannot run a sandbox (made by
  :func:`unavailable`, which says what it needs);
- :class:`DockerfileError`: a task's Dockerfile cannot be read or built here (a
  ``ValueError``: the task is at fault, not the run);
- :class:`BuildError`: a Dockerfile step failed; names the step, shows its last output;
- :class:`SpawnFailed`: the sandbox's helper could not start a command (unknown user,
  missing directory...), with the exit code ``docker exec`` reports for it;
- :class:`ChannelClosed`: the sandbox's helper is gone (stopped, or its processes died);
- :class:`TransferIncomplete`: a copy out of a trial left something out (whatever fitted
  was copied);
- :class:`FileTooLarge`: a file a trial or build wrote is larger than its reader's bound.
"""

from __future__ import annotations

__all__ = ["BuildError", "ChannelClosed", "DockerfileError", "FileTooLarge",
           "SandboxUnavailableError", "SpawnFailed", "TransferIncomplete", "unavailable"]


class SandboxUnavailableError(RuntimeError):
    """This machine cannot run the docker-free environment; the message says what is
    missing and what to do."""


def unavailable(reason: str) -> SandboxUnavailableError:
    return SandboxUnavailableError(
        f"LocalEnvironment cannot run on this machine: {reason}. It needs Linux, root, "
        "overlayfs, util-linux (unshare, mount), bubblewrap, slirp4netns, keyutils (keyctl) "
        "and libseccomp (`make test` installs the last four with apt-get). "
        "Use harbor's Docker environment instead (-e docker)."
    )


class DockerfileError(ValueError):
    """The Dockerfile cannot be read or built here; the message names the line."""


class BuildError(RuntimeError):
    """A Dockerfile step failed; the message names the step and shows its last output."""


class SpawnFailed(Exception):
    """The helper could not start the command (unknown user, missing directory...)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class ChannelClosed(RuntimeError):
    """The sandbox's helper is gone: the trial was stopped or its processes died."""


class TransferIncomplete(RuntimeError):
    """A copy left something out: the message says what, why, and how to raise the
    bound. Whatever fitted was copied."""


class FileTooLarge(OSError):
    """A file is larger than the bound its reader allowed."""
