"""The docker-free environment: harbor tasks built and run in bubblewrap sandboxes.

- `LocalEnvironment`: the harbor environment (`-e wmo_trio.harbor:LocalEnvironment`).
- `ImageCache`: the built images (`wmo-trio sandbox images` / `prune`).
- `SandboxUnavailableError`: this machine cannot run sandboxes (the message says why).
- `BuildError`, `DockerfileError`: a task's Dockerfile failed, or cannot be built here.
- For another sandbox of this machine (the sandbox backend's runner,
  ``wmo_trio.backends._sandbox_runner``): the trial's `TRIAL_PROFILE`, which such a
  sandbox changes with `dataclasses.replace` (`Profile`), `bwrap_argv` and `launch_argv`
  to start it, `profile_problem` to check it can, and its cgroup (`Limits`,
  `TrialCgroup`).

Module by job (docs/architecture.md has the table): `_dockerfile` reads Dockerfiles,
`_image` caches images and `_build` builds them (`_packing` the layers a COPY places,
`_stand_in` what stands in for FROM), `_rootfs` chooses the host layers, `_profile` is
what every sandbox holds to and its bubblewrap command line (`_seccomp` compiles its
system-call filter), `_namespace` starts and ends sandboxes (`_state` their state
directory, `_overlay` the overlay root, `_network` slirp4netns, `_storage` a trial's
filesystem of its `storage_mb`, `_cgroup` its ceilings), `_processes` runs commands in
them, `_transfer` copies files out and `_upload` in (`_reward` the verifier's reward files, bounded),
`_hostfs` is the host's rule for paths a trial or a build wrote, `_helper` is the
process inside every sandbox, `_environment` is harbor's interface (`_options` its
options and ceilings, `_sweep` a start's sweep of dead processes' leftovers), `_errors`
the wing's errors, `_threads` what a worker thread makes and the caller owns.

`LocalEnvironment` is imported on first use, as it brings harbor's environment classes:
checking whether this machine can run sandboxes, or listing the image cache, does not
load harbor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wmo_trio._lazy import lazy_exports
from wmo_trio.sandbox._cgroup import Limits, TrialCgroup
from wmo_trio.sandbox._errors import BuildError, DockerfileError, SandboxUnavailableError
from wmo_trio.sandbox._hostfs import remove_tree
from wmo_trio.sandbox._image import CachedImage, ImageCache, default_cache_dir
from wmo_trio.sandbox._profile import (
    LAUNCH_ATTEMPTS,
    TRIAL_PROFILE,
    Bind,
    Profile,
    bwrap_argv,
    launch_argv,
    launch_output,
    lost_loopback_race,
    profile_problem,
)
from wmo_trio.sandbox._state import wait_for_removals

if TYPE_CHECKING:
    from wmo_trio.sandbox._environment import LocalEnvironment

__all__ = [
    "LAUNCH_ATTEMPTS",
    "TRIAL_PROFILE",
    "Bind",
    "BuildError",
    "CachedImage",
    "DockerfileError",
    "ImageCache",
    "Limits",
    "LocalEnvironment",
    "Profile",
    "SandboxUnavailableError",
    "TrialCgroup",
    "bwrap_argv",
    "default_cache_dir",
    "launch_argv",
    "launch_output",
    "lost_loopback_race",
    "profile_problem",
    "remove_tree",
    "wait_for_removals",
]

__getattr__ = lazy_exports(__name__, {"LocalEnvironment": "wmo_trio.sandbox._environment"})
