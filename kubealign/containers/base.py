"""The base image for offline builds where no registry is reachable: Debian bookworm made with
debootstrap (minbase + python3, venv, the Python headers, g++, passwd), imported into the daemon as
BOOTSTRAP_IMAGE. The compiler is not optional: DeepSpeed on CPU JIT-compiles its shared-memory comm op
(deepspeed_shm_comm) in every process that initializes it, which every training stage does.

Debian's python3 there is 3.11.2 (the slim image pins 3.11.7); the lock's wheels are cp311 and run on
either. It is made once per daemon (about a minute with a near mirror, 3-4 min otherwise) and reused.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubealign.errors import UserError

BOOTSTRAP_IMAGE = "kubealign-base:bookworm-2"  # -N: bumped whenever PACKAGES change
SUITE = "bookworm"
PACKAGES = ("python3", "python3-venv", "python3-dev", "g++", "passwd")
APT_SOURCES = (Path("/etc/apt/sources.list.d"), Path("/etc/apt/sources.list"))


def apt_mirror(sources: tuple[Path, ...] = APT_SOURCES) -> str:
    """The Debian mirror this machine's apt uses for `bookworm` (its deb822 .sources or sources.list):
    the base comes from where the host's own packages come from, never a hard-coded host."""
    files: list[Path] = []
    for source in sources:
        if source.is_dir():
            files += sorted(source.glob("*.sources")) + sorted(source.glob("*.list"))
        elif source.is_file():
            files.append(source)
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for stanza in re.split(r"\n\s*\n", text):  # deb822: blank-line separated stanzas
            uris = re.search(r"^URIs:\s*(\S+)", stanza, flags=re.M)
            suites = re.search(r"^Suites:\s*(.+)$", stanza, flags=re.M)
            if uris and suites and SUITE in suites.group(1).split():
                return uris.group(1)
        for match in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)", text, flags=re.M):
            if match.group(2) == SUITE:
                return match.group(1)
    raise UserError(f"no apt source for Debian {SUITE} in {', '.join(map(str, sources))}: cannot debootstrap a base")


def exists(client: Any, image: str) -> bool:
    import docker

    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        return False
    return True


def bootstrap(client: Any, say: Callable[[str], None] = print, image: str = BOOTSTRAP_IMAGE) -> str:
    """Make and import the base unless the daemon already has it; returns its name."""
    if exists(client, image):
        return image
    if shutil.which("debootstrap") is None:
        raise UserError("debootstrap is not installed: `apt-get install debootstrap` (as root), or pass --base IMAGE")
    mirror = apt_mirror()
    say(f"making {image}: debootstrap {SUITE} (minbase + {', '.join(PACKAGES)})")
    with tempfile.TemporaryDirectory(prefix="kubealign-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        command = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(rootfs), mirror]
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["(no output)"]
            raise UserError(f"debootstrap failed (exit {proc.returncode}): {tail[0]}")
        # apt's package cache and lists are of no use in an image that never runs apt
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(rootfs / junk, ignore_errors=True)
        archive = Path(tmp) / "rootfs.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(rootfs, arcname=".")
        repository, tag = image.rsplit(":", 1)
        changes = ['ENV PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"', 'CMD ["python3"]']
        client.api.import_image_from_file(str(archive), repository=repository, tag=tag, changes=changes)
    return image
