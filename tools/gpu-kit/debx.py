#!/usr/bin/env python3
"""Unpack a Debian package's files into a directory, like `dpkg -x DEB DIR`.

What it is: tools/gpu-kit/run's fallback for a machine without dpkg. A .deb is an ar archive
whose member data.tar.{xz,gz,bz2} holds the files; this extracts that tar under DIR,
refusing members whose path would land outside it.
What it is not: an installer: no maintainer scripts, no alternatives, no database.

Usage: debx.py DEB DIR
"""
import io
import os
import sys
import tarfile


def ar_members(data):
    if not data.startswith(b"!<arch>\n"):
        raise SystemExit("error: debx: not an ar archive (a .deb starts with !<arch>)")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        yield name, data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)


def main():
    if len(sys.argv) != 3:
        raise SystemExit("usage: debx.py DEB DIR")
    deb, out = sys.argv[1], os.path.realpath(sys.argv[2])
    with open(deb, "rb") as f:
        data = f.read()
    for name, member in ar_members(data):
        if not name.startswith("data.tar"):
            continue
        with tarfile.open(fileobj=io.BytesIO(member), mode="r:*") as tar:
            for info in tar.getmembers():
                target = os.path.realpath(os.path.join(out, info.name))
                if target != out and not target.startswith(out + os.sep):
                    raise SystemExit(f"error: debx: {deb}: {info.name} leaves {out}")
            # Links are kept as dpkg -x keeps them (an absolute one points into /).
            if hasattr(tarfile, "tar_filter"):
                tar.extractall(out, filter="tar")
            else:
                tar.extractall(out)
        return
    raise SystemExit(f"error: debx: {deb} has no data.tar member")


if __name__ == "__main__":
    main()
