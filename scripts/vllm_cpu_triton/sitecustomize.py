"""A stand-in "cpu" Triton backend for vLLM's CPU wheel, for scripts/vllm_compare.py only.

The wheel disables Triton where Triton has no CPU backend, and its DSpark path runs only on model
runner V2, which needs Triton. With DSPARK_TRITON_CPU_STANDIN=1 this registers a backend named
"cpu" whose driver answers the few questions vLLM asks at start-up; TRITON_INTERPRET=1 must be set
too, so that the kernels run in Triton's interpreter and never reach this driver's compiler.
Python imports this module at start-up when its folder is on PYTHONPATH.
"""

import os

if os.environ.get("DSPARK_TRITON_CPU_STANDIN") == "1":
    try:
        from triton.backends import Backend, backends
        from triton.backends.compiler import BaseBackend, GPUTarget

        class _InterpreterDriver:
            @classmethod
            def is_active(cls):
                return True

            def get_current_device(self):
                return 0

            def get_active_torch_device(self):
                import torch
                return torch.device("cpu")

            def get_current_target(self):
                return GPUTarget("cpu", 0, 0)

        backends.setdefault("cpu", Backend(compiler=BaseBackend, driver=_InterpreterDriver))
    except Exception as e:  # noqa: BLE001 - without it vLLM refuses DSpark, and says so
        print(f"vllm_cpu_triton: no stand-in backend ({type(e).__name__}: {e})")
