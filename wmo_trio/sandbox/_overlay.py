"""A sandbox's root as overlays, written as one mount table in its state directory.

The root is one overlay per system directory of the host (``_rootfs.HostLayers``)
under a root overlay on the host's skeleton; an image's layer, where the trial has one,
lies on top of each. Their upper and work directories are in the state directory (with
``storage_bytes``, in a filesystem of that size of their own: ``_storage``), and so is
the table (``fstab``) that one run of mount(8) reads in the launch's private mount
namespace, a parent before its children. Every path in the overlays' options is
relative to the state directory, where mount(8) runs: a trial's
``/proc/self/mountinfo`` shows them, as Docker's shows its own, and they name no host
path.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from wmo_trio.sandbox import _storage
from wmo_trio.sandbox._errors import unavailable
from wmo_trio.sandbox._network import RESOLV_CONF
from wmo_trio.sandbox._profile import Bind
from wmo_trio.sandbox._rootfs import HostLayers, make_hiding_layer

__all__ = ["SCRATCH", "SandboxRoot", "container_etc_files", "prepare_root"]

# What a launch made in the state directory besides its launch log: removed before a
# launch is tried again, or when a stopped trial's changes are kept.
SCRATCH = ("upper", "work", "root", "hidden", "layers", _storage.TOP, _storage.IMAGE)
_UNSAFE_OVERLAY_PATH = re.compile(r"[,:\\\s]")


@dataclass(frozen=True)
class SandboxRoot:
    """What a sandbox's root is made of: the host's layers, an image's layer (a build's
    sandbox has none), host paths bound into it, files written into its ``/etc``, and
    the bytes its writes may take (None: no bound; see ``_storage``)."""

    host: HostLayers
    image_layer: Path | None = None
    binds: tuple[Bind, ...] = ()
    etc_files: Mapping[str, str] = field(default_factory=dict)
    storage_bytes: int | None = None


def container_etc_files(hostname: str, *, network: bool) -> dict[str, str]:
    """What Docker writes into a container's ``/etc``: its hostname, its hosts file, and
    with a network, the resolver (slirp4netns's DNS forwarder)."""
    etc = {"hostname": f"{hostname}\n",
           "hosts": f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                    f"127.0.1.1\t{hostname}\n"}
    if network:
        etc["resolv.conf"] = RESOLV_CONF
    return etc


def prepare_root(state: Path, spec: SandboxRoot) -> str:
    """Make the upper, work, hiding and mount-point directories in the state directory
    ``state``, and the table of the overlays to mount; the shell command that mounts
    them. With ``storage_bytes``, the upper and work directories are made in
    ``_storage.TOP`` and copied into a filesystem of that size, which the table mounts
    over them first."""
    host, image_layer, storage_bytes = spec.host, spec.image_layer, spec.storage_bytes
    base = state / _storage.TOP if storage_bytes is not None else state
    upper, work, root = base / "upper", base / "work", state / "root"
    hiding = state / "hidden"
    make_hiding_layer(hiding, host.hidden)
    mounts: list[str] = []
    layers: dict[str, str] = {}
    for name in ("", *host.system):
        directory = name or "_root"
        (upper / directory).mkdir(parents=True, exist_ok=True)
        (work / directory).mkdir(parents=True, exist_ok=True)
        lower = _lower_dirs(host, image_layer, name, hiding)
        options = _overlay_options(lower, upper / directory, work / directory, state, layers)
        mounts.append(f"overlay {root}/{name} overlay {options},nodev 0 0\n")
    root.mkdir(exist_ok=True)
    for bind in spec.binds:
        # bubblewrap makes missing mount points mode 0700; Docker makes them 0755.
        top = bind.target.strip("/").split("/")[0]
        if top and top not in host.system:
            target = upper / "_root" / bind.target.strip("/")
            target.mkdir(mode=0o755, parents=True, exist_ok=True)
    for relative, text in spec.etc_files.items():
        (upper / "etc" / relative).write_text(text)
    if storage_bytes is not None:  # made last: it copies what is prepared above
        mounts.insert(0, _storage.make(state, storage_bytes))
    # One table for one run of mount(8): a run per overlay costs a start of it each.
    (state / "fstab").write_text("".join(mounts))
    return f"cd {shlex.quote(str(state))} && mount --all --fstab fstab"


def _lower_dirs(host: HostLayers, image_layer: Path | None, name: str,
                hiding: Path) -> list[str]:
    """The lower directories of the overlay of the system directory ``name`` (the
    root's for ""), top first: the image's layer, then the host's."""
    if not name:
        return [*([str(image_layer / "_root")] if image_layer is not None else []),
                str(host.skeleton)]
    lower = host.lower_dirs(name, hiding)
    if image_layer is not None and (image_layer / name).is_dir():
        lower.insert(0, str(image_layer / name))
    return lower


def _overlay_options(lower: Sequence[str], upper: Path, work: Path, state: Path,
                     layers: dict[str, str]) -> str:
    """The overlay's options, every path relative to ``state``. A lower directory is
    named by a link of ``state``'s ``layers/`` (``layers`` maps each path to its link,
    made on first use)."""
    for path in [*lower, str(upper), str(work)]:
        if _UNSAFE_OVERLAY_PATH.search(path):
            raise unavailable(f"the path {path} holds a character overlayfs options cannot "
                              "carry (comma, colon, backslash or space); choose other "
                              "state_dir and cache_dir")
    for path in lower:
        if path not in layers:
            layers[path] = f"layers/{len(layers)}"
            (state / "layers").mkdir(exist_ok=True)
            os.symlink(path, state / layers[path])
    names = ":".join(layers[path] for path in lower)
    return (f"lowerdir={names},upperdir={upper.relative_to(state)},"
            f"workdir={work.relative_to(state)}")
