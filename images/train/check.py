"""What the training image must hold, checked inside it: `kubealign images build --image train` runs this in
the image it built (`docker run IMAGE python -c <this file> EXPECTED`, no network, as the image's user)
and fails the build on any problem; the `train_image` test tier asserts on its report.

EXPECTED (one JSON argument): {"uid": 10001, "cuda": "13.0", "ops": [op names DeepSpeed must list as
installed], "versions": {name: the version a distribution of that name must have}, "required": [names that
must be there: torch's CUDA build and what it brings, deepspeed, kubealign], "allowed": [names that may also
be there at any version: pip], "absent": [names that must not be there: the build-only CUDA compiler]}.
Every other distribution is a problem: nothing from outside the lock and images/train/cuda.txt.

Prints one JSON report; exit 0 when it lists no problem, 1 otherwise. No GPU is needed: a prebuilt op is
loaded through DeepSpeed's own op builder under the cuda accelerator, which imports the compiled module
(links against this torch and CUDA's libraries) and, with no GPU, skips only the CUDA-version comparison,
which is made here against the version DeepSpeed recorded at build time instead.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys

BUILDERS = {"fused_adam": "FusedAdamBuilder", "transformer_inference": "InferenceBuilder", "cpu_adam": "CPUAdamBuilder"}


def _name(raw: str) -> str:
    return re.sub(r"[-_.]+", "-", raw).lower()


def distributions(expected: dict) -> tuple[dict, list[str]]:
    """Every distribution in the environment against the expected versions."""
    inside = {_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    problems = []
    for name, version in sorted(inside.items()):
        if name in expected["versions"]:
            if version != expected["versions"][name]:
                problems.append(f"{name} {version}, expected {expected['versions'][name]}")
        elif name in expected["absent"]:
            problems.append(f"{name} {version} is build-only and must not be in the image")
        elif name not in expected["allowed"]:
            problems.append(f"{name} {version} is neither in the lock nor in images/train/cuda.txt")
    missing = sorted(set(expected["required"]) - set(inside))
    problems += [f"{name} is missing" for name in missing]
    return inside, problems


def torch_report(expected: dict) -> tuple[dict, list[str]]:
    import torch

    report = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_built": torch.backends.cuda.is_built(),
        "cudnn": torch.backends.cudnn.version(),
        "arch_list": torch.cuda.get_arch_list(),
        "cuda_available": torch.cuda.is_available(),
    }
    problems = []
    if torch.version.cuda != expected["cuda"] or not report["cuda_built"]:
        problems.append(f"torch {torch.__version__} is not a CUDA {expected['cuda']} build (cuda={torch.version.cuda})")
    if not report["cudnn"]:
        problems.append("torch finds no cuDNN")
    return report, problems


def deepspeed_report(expected: dict) -> tuple[dict, list[str]]:
    os.environ["DS_ACCELERATOR"] = "cuda"  # no GPU here: without it DeepSpeed picks cpu and ignores the prebuilt ops
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops, torch_info

    report = {
        "version": deepspeed.__version__,
        "accelerator": accelerator_name,
        "built_with": torch_info,
        "installed_ops": sorted(op for op, on in installed_ops.items() if on),
        "loaded": {},
    }
    problems = []
    if accelerator_name != "cuda":
        problems.append(f"DeepSpeed's ops were built for the {accelerator_name} accelerator, not cuda")
    torch_mm = ".".join(torch.__version__.split(".")[:2])
    cuda_mm = ".".join((torch.version.cuda or "").split(".")[:2])
    if torch_info.get("version") != torch_mm or torch_info.get("cuda_version") != cuda_mm:
        problems.append(f"ops built with torch {torch_info} but torch here is {torch_mm} with CUDA {cuda_mm}")
    for op in expected["ops"]:
        if not installed_ops.get(op):
            problems.append(f"DeepSpeed lists {op} as not installed (it would JIT-compile, and the image has no nvcc)")
            continue
        builder = get_accelerator().create_op_builder(BUILDERS[op])
        try:
            module = builder.load(verbose=False)
            report["loaded"][op] = os.path.relpath(module.__file__, os.path.dirname(deepspeed.__file__))
        except Exception as exc:  # a version check, an undefined symbol, a missing library
            problems.append(f"{op} does not load: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return report, problems


def writable_by_others(root: str) -> list[str]:
    """Files and directories under root that a group or another user may write (a prebuilt op that a
    compromised process of another uid could replace): "N writable by group/others under ROOT (first: ...)"."""
    found = []
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(top, name)
            if not os.path.islink(path) and os.lstat(path).st_mode & 0o022:
                found.append(path)
    if not found:
        return []
    return [f"{len(found)} writable by group/others under {root} (first: {', '.join(sorted(found)[:3])})"]


def main() -> int:
    expected = json.loads(sys.argv[1])
    report: dict = {"uid": os.getuid(), "python": sys.version.split()[0]}
    problems = [] if os.getuid() == expected["uid"] else [f"runs as uid {os.getuid()}, not {expected['uid']}"]
    inside, found = distributions(expected)
    report["distributions"] = len(inside)
    problems += found
    for key, part in (("torch", torch_report), ("deepspeed", deepspeed_report)):
        try:
            report[key], found = part(expected)
        except Exception as exc:
            report[key], found = None, [f"{key}: {type(exc).__name__}: {exc}"]
        problems += found
    problems += writable_by_others(sys.prefix)
    report["problems"] = problems
    print(json.dumps(report))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
