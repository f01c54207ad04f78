"""Which instruction set the native quantized kernels run, decided once per process.

The C++ side picks AVX2 or the portable scalar code from the CPU's features and never AVX-512 on
its own: a virtual machine's cpuid may list instructions that then fault. AVX-512 runs only after
``avx512_probe()`` (a few AVX-512 F/BW/VL instructions whose results it checks) succeeded in a
forked child, where a SIGILL kills nobody but the child. ``PDSERVE_KERNEL_ISA`` (``auto``,
``avx512``, ``avx2``, ``scalar``) overrides the choice; ``auto`` there means "probe".

Every native module built on ``quantized_linear.h`` holds its own choice, so each is given it as
it loads (``kernels.load_native``).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)

ISA_ENV = "PDSERVE_KERNEL_ISA"
ISAS = ("auto", "avx512", "avx2", "scalar")
_avx512_runs: bool | None = None  # the probe's verdict, once this process asked


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
