"""Which instruction set the native quantized kernels run, decided once per process.

The C++ side picks AVX2 or the portable scalar code from the CPU's features and never AVX-512 on
its own: a virtual machine's cpuid may list instructions that then fault. AVX-512 runs only after
``avx512_probe()`` (a few AVX-512 F/BW/VL instructions whose results it checks) succeeded in a
forked child, where a SIGILL kills nobody but the child. ``PDSERVE_KERNEL_ISA`` (``auto``,
``avx512``, ``avx2``, ``scalar``) overrides the choice; ``auto`` there means "probe".

Every native module built on ``quantized_linear.h`` holds its own choice, so each is given it as
it loads (``kernels.load_native``).

The same goes for what decode rows multiply the quantized weights with (the engine config's
``activation_dtype``): ``float32`` activations, or ``int8`` (each row of x quantized to 8-bit groups
once per matmul input, integer dot products: ``quantized_int8.h``). It is one choice per process
(``set_activation_dtype``), given to every module loaded before or after. ``auto`` is float32: the
accuracy gate (``benchmarks/engine/accuracy.py``) has not yet made int8 a default.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from types import ModuleType

log = logging.getLogger(__name__)

ISA_ENV = "PDSERVE_KERNEL_ISA"
ISAS = ("auto", "avx512", "avx2", "scalar")
ACTIVATION_DTYPES = ("auto", "int8", "float32")
_avx512_runs: bool | None = None  # the probe's verdict, once this process asked
_activation_dtype = "float32"  # this process's choice (set_activation_dtype)


def avx512_runs(module: ModuleType) -> bool:
    """Whether AVX-512 F/BW/VL instructions run on this machine: cpuid lists them and the probe,
    run in a forked child, returned a correct value (asked once per process)."""
    global _avx512_runs
    if _avx512_runs is None:
        _avx512_runs = bool(module.avx512_supported()) and _probe_in_child(module)
    return _avx512_runs


def _probe_in_child(module: ModuleType) -> bool:
    pid = os.fork()
    if pid == 0:  # the child: only the probe, then out without any cleanup
        try:
            passed = bool(module.avx512_probe())
        except BaseException:
            passed = False
        os._exit(0 if passed else 1)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        log.warning("AVX-512 probe died of signal %d: the kernels run AVX2", os.WTERMSIG(status))
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def chosen_isa(module: ModuleType) -> str:
    """What ``set_isa`` is given: the environment's override, else ``avx512`` where the probe
    passed, else ``auto`` (AVX2 where the CPU has it, scalar elsewhere)."""
    wanted = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if wanted not in ISAS:
        raise ValueError(f"{ISA_ENV}={wanted!r}: one of {', '.join(ISAS)}")
    if wanted != "auto":
        return wanted
    return "avx512" if avx512_runs(module) else "auto"


def apply_isa(module: ModuleType) -> str:
    """Set ``module``'s instruction set to ``chosen_isa``; returns the path it now runs."""
    module.set_isa(chosen_isa(module))
    return str(module.isa())


def resolved_activation_dtype(name: str) -> str:
    """What ``activation_dtype`` ``name`` runs: ``auto`` is float32 (module docstring)."""
    if name not in ACTIVATION_DTYPES:
        raise ValueError(f"activation_dtype {name!r}: one of {', '.join(ACTIVATION_DTYPES)}")
    return "float32" if name == "auto" else name


def activation_dtype() -> str:
    """This process's activation dtype: ``int8`` or ``float32``."""
    return _activation_dtype


def set_activation_dtype(name: str, modules: Iterable[ModuleType] = ()) -> str:
    """Make ``name`` this process's activation dtype and give it to ``modules`` (those loaded
    already); returns the dtype that runs."""
    global _activation_dtype
    _activation_dtype = resolved_activation_dtype(name)
    for module in modules:
        apply_activation_dtype(module)
    return _activation_dtype


def apply_activation_dtype(module: ModuleType) -> None:
    if hasattr(module, "set_activation_dtype"):
        module.set_activation_dtype(_activation_dtype)
