"""Container images and a Docker daemon for them, on a machine without a registry or systemd.

- daemon: a private dockerd (its own socket, data root and state dir) that `make images`, the
  `container` test tier and `kubealign run --runner docker` can start and stop.
- base: the base image where no registry is reachable (debootstrap'ed Debian bookworm + python3).
- build: the offline image build (a wheelhouse from the lock, `--no-index` inside the build).
"""
