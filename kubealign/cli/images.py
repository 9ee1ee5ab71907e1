"""`kubealign images`: the container images built offline (build) and kubealign's private Docker daemon to build
them with (daemon); kubealign.containers does the work."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    images_ = sub.add_parser("images", help="build the container images offline; a private Docker daemon for them")
    images_sub = images_.add_subparsers(dest="images_command", required=True, metavar="ACTION")
    build = images_sub.add_parser(
        "build",
        help="build an image from a wheelhouse of the lock, with no network inside the build",
        description="Makes (once per lock) a wheelhouse of the locked dependencies, stages it with the image's "
        "Dockerfile and builds with --no-index and no network. Uses $DOCKER_HOST, else kubealign's daemon "
        "(`kubealign images daemon start`), else /var/run/docker.sock.",
    )
    build.add_argument(
        "--image",
        choices=["cpu", "train", "serve"],
        default="cpu",
        help="which image (default: cpu; serve: vLLM's CPU server for KServe's vllm runtime)",
    )
    build.add_argument(
        "--base",
        default="auto",
        metavar="auto|bootstrap|IMAGE",
        help="base of the image: auto (the Python image if it can be had, else bootstrap), bootstrap (Debian "
        "bookworm made here with debootstrap) or an image the daemon has (Python 3.11 with venv, headers, g++)",
    )
    build.add_argument(
        "--cuda-arch-list",
        metavar="ARCHS",
        help="train image: TORCH_CUDA_ARCH_LIST to compile DeepSpeed's ops for (default: the Dockerfile's "
        "'8.0;8.6;8.9;9.0'; each arch adds build time)",
    )
    daemon_ = images_sub.add_parser("daemon", help="start, stop or show kubealign's private dockerd")
    daemon_.add_argument("action", choices=["start", "stop", "status"])
    images_.set_defaults(func=images_command)


def images_command(args: argparse.Namespace) -> None:
    from kubealign.containers import build, daemon

    if args.images_command == "daemon":
        if args.action == "start":
            print(f"export DOCKER_HOST={daemon.start()}")
        elif args.action == "stop":
            print("stopped" if daemon.stop() else "not running")
        else:
            pid, sock = daemon.pid(), daemon.state_dir() / "docker.sock"
            print(f"running (pid {pid}), DOCKER_HOST=unix://{sock}" if pid else "not running")
        return
    client = daemon.client()
    try:
        built = build.build(client, args.image, args.base, say=print, cuda_arch_list=args.cuda_arch_list)
    finally:
        client.close()
    if built.check:
        torch, ds = built.check["torch"], built.check["deepspeed"]
        print(
            f"checked in the image: torch {torch['version']} (CUDA {torch['cuda']}), "
            f"deepspeed {ds['version']} with {', '.join(sorted(ds['loaded']))} prebuilt and loading, "
            f"{built.check['distributions']} distributions at their pinned versions, uid {built.check['uid']}"
        )
    print(
        f"built {built.image}: {built.size_bytes / 1e9:.2f} GB, Python {built.python}, base {built.base}, "
        f"{built.seconds:.0f} s"
    )
