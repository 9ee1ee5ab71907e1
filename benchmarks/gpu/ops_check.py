"""Do DeepSpeed's prebuilt CUDA ops load here? Run by run.sh on the GPU machine after the wheels are
installed, in the environment the benchmark uses. Prints one JSON line; exit 0: every op the installed
DeepSpeed lists as prebuilt loads (or none is listed: the pure wheel, which JIT-builds); 1: a prebuilt op
does not load (run.sh then installs the pure wheel instead); 2: DeepSpeed itself does not import (the pure
wheel would not either: run.sh's import check says why); 3: no CUDA here, nothing was checked.

It asks DeepSpeed's own op_builder.load(), which for a prebuilt op checks the torch and CUDA versions it
was built with against the running ones (validate_torch_version, validate_torch_op_version) and imports
it; for an op that is not prebuilt, load() would JIT-compile it, so such ops are not loaded here.
"""

from __future__ import annotations

import importlib
import json
import sys

OPS = {"fused_adam": "FusedAdamBuilder", "transformer_inference": "InferenceBuilder"}
IMPORTS = {
    "fused_adam": "deepspeed.ops.adam.fused_adam_op",
    "transformer_inference": "deepspeed.ops.transformer.inference.transformer_inference_op",
}


def main() -> int:
    import torch

    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops, torch_info
    except Exception as exc:
        print(json.dumps({"deepspeed_imports": False, "error": f"{type(exc).__name__}: {exc}"}))
        return 2

    report = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "built_with": torch_info,
        "prebuilt": sorted(op for op in OPS if installed_ops.get(op)),
    }
    if not torch.cuda.is_available():
        # DeepSpeed's load() takes a prebuilt op only under the CUDA accelerator: here it would JIT-build.
        # Importing the module still shows that it links against this torch (no symbol missing); its
        # kernels need a GPU and libcuda to run, which this machine lacks.
        report["checked"] = "no CUDA here: the modules imported, nothing ran"
        report["imported"] = {}
        for op in report["prebuilt"]:
            try:
                importlib.import_module(IMPORTS[op])
                report["imported"][op] = "yes"
            except Exception as exc:
                report["imported"][op] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(report))
        return 3
    failed = {}
    for op in report["prebuilt"]:
        try:
            get_accelerator().create_op_builder(OPS[op]).load(verbose=False)
        except Exception as exc:  # a version check, an undefined symbol, a missing library
            failed[op] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    report.update(checked="yes", failed=failed)
    print(json.dumps(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
