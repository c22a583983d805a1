"""The ExecuTorch runtime driver every portable script uses (the conformance scripts and, embedded
in the binary, `petite verify`): one method of a .pte in executorch-numpy-runtime ("numpy") or
executorch 1.5.1 ("torch"), with bf16 as uint16 bits."""
import sys

import numpy as np


class Runner:
    """One method of a .pte in executorch-numpy-runtime ("numpy") or executorch 1.5.1 ("torch")."""

    def __init__(self, path, runtime, method="forward"):
        self.runtime = runtime
        if runtime == "numpy":
            import executorch_numpy_runtime as et
            self.m = et.Runtime.get().load_program(path).load_method(method)
        else:
            import torch  # noqa: F401  (executorch's pybindings need it loaded first)
            from executorch.runtime import Runtime, Verification
            prog = Runtime.get().load_program(path, verification=Verification.InternalConsistency)
            self.m = prog.load_method(method)

    def __call__(self, arrays, bf16=None):
        if self.runtime == "numpy":
            return [np.asarray(o) for o in self.m(arrays)]
        import torch
        bf16 = bf16 or [False] * len(arrays)
        ts = [torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if b else torch.from_numpy(a)
              for a, b in zip(arrays, bf16)]
        outs = []
        for o in self.m.execute(ts):
            if o.dtype == torch.bfloat16:
                outs.append(o.view(torch.int16).numpy().view(np.uint16))
            else:
                outs.append(o.numpy())
        return outs


def runtime_arg():
    return sys.argv[sys.argv.index("--runtime") + 1] if "--runtime" in sys.argv else "numpy"
