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

Batch invariance (``set_batch_invariant``, on where the engine speculates) is one more such
choice: a decode row's logits must not depend on the rows beside it. The float32 kernels sum
every row alike in any tile; 8-bit activations then take every row count, not only the few rows
they are fastest at.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from types import ModuleType

import torch

from engine.config import ACTIVATION_DTYPES, PROMPT_MATMUL_DTYPES

log = logging.getLogger(__name__)

ISA_ENV = "PDSERVE_KERNEL_ISA"
ISAS = ("auto", "avx512", "avx2", "scalar")
_avx512_runs: bool | None = None  # the probe's verdict, once this process asked
_bfloat16_gemm: str | None = None  # how torch's bfloat16 GEMM runs here, once asked
_activation_dtype = "float32"  # this process's choice (set_activation_dtype)
_batch_invariant = False  # ... and set_batch_invariant's


def avx512_runs(module: ModuleType) -> bool:
    """Whether AVX-512 F/BW/VL instructions run on this machine: cpuid lists them and the probe,
    run in a forked child, returned a correct value (asked once per process)."""
    global _avx512_runs
    if _avx512_runs is None:
        _avx512_runs = bool(module.avx512_supported()) and _probe_in_child(module)
    return _avx512_runs


def _probe_in_child(module: ModuleType) -> bool:
    return _passes_in_child(lambda: bool(module.avx512_probe()), "AVX-512", "the kernels run AVX2")


def _passes_in_child(probe: Callable[[], bool], what: str, otherwise: str) -> bool:
    """Whether ``probe()`` returned True in a forked child (a SIGILL kills only the child)."""
    pid = os.fork()
    if pid == 0:  # the child: only the probe, then out without any cleanup
        try:
            passed = probe()
        except BaseException:
            passed = False
        os._exit(0 if passed else 1)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        log.warning("%s probe died of signal %d: %s", what, os.WTERMSIG(status), otherwise)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def bfloat16_gemm() -> str:
    """How torch multiplies bfloat16 matrices on this CPU, asked once per process: ``native``
    where its CPU info lists AVX512_BF16 or AMX and a bfloat16 GEMM run in a forked child gave
    the product of the rounded values; ``emulated`` where neither is listed (correct, several
    times slower than float32); ``faulty`` where they are listed but the child's GEMM died or
    was wrong (a virtual machine's cpuid may list AMX that faults)."""
    global _bfloat16_gemm
    if _bfloat16_gemm is None:
        if not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
            _bfloat16_gemm = "emulated"
        elif _passes_in_child(_bfloat16_gemm_probe, "bfloat16 GEMM", "prompts stay float32"):
            _bfloat16_gemm = "native"
        else:
            _bfloat16_gemm = "faulty"
    return _bfloat16_gemm


def _bfloat16_gemm_probe() -> bool:
    torch.set_num_threads(1)
    x = torch.linspace(-2, 2, 64 * 96).reshape(64, 96)
    w = torch.linspace(1, -1, 96 * 80).reshape(80, 96)
    product = (x.bfloat16() @ w.bfloat16().t()).float()
    # the same product of the rounded values, by float32 products and sums: no GEMM
    expected = (x.bfloat16().float()[:, None, :] * w.bfloat16().float()[None]).sum(-1)
    return bool(torch.allclose(product, expected, rtol=1e-2, atol=1e-2))


def resolved_prompt_matmul_dtype(name: str, device: torch.device) -> str:
    """What ``prompt_matmul_dtype`` ``name`` runs. ``auto`` is float32: bfloat16 prompts run
    faster where the CPU executes bfloat16 (``benchmarks.engine.prompt_dtype``) and move the
    distributions far less than llama.cpp's arithmetic, but keep 96-97 % of the top-1 tokens on
    the bundled files, under the accuracy gate's 98 % floor (``benchmarks/engine/accuracy.py``).
    ``bfloat16`` on a CPU runs where ``bfloat16_gemm`` is native, runs with a warning where it
    is emulated (slower), and falls back to float32 with a warning where it is faulty."""
    if name not in PROMPT_MATMUL_DTYPES:
        raise ValueError(f"prompt_matmul_dtype {name!r}: one of {', '.join(PROMPT_MATMUL_DTYPES)}")
    if name != "bfloat16" or device.type != "cpu":
        return "float32" if name == "auto" else name
    gemm = bfloat16_gemm()
    if gemm == "emulated":
        log.warning(
            "prompt_matmul_dtype bfloat16: this CPU executes no bfloat16 GEMM instructions "
            "(AVX512_BF16, AMX), so torch emulates them, several times slower than float32"
        )
    elif gemm == "faulty":
        log.warning(
            "prompt_matmul_dtype bfloat16: this CPU lists bfloat16 GEMM instructions, but a "
            "bfloat16 GEMM died or was wrong in a child process: prompts multiply in float32"
        )
        return "float32"
    return "bfloat16"


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


def batch_invariant() -> bool:
    """Whether this process keeps every decode row's result independent of its step's rows."""
    return _batch_invariant


def set_batch_invariant(on: bool, modules: Iterable[ModuleType] = ()) -> None:
    """Make ``on`` this process's batch invariance and give it to ``modules``."""
    global _batch_invariant
    _batch_invariant = on
    for module in modules:
        apply_activation_dtype(module)


def apply_activation_dtype(module: ModuleType) -> None:
    """Give ``module`` this process's activation dtype and batch invariance."""
    if hasattr(module, "set_activation_dtype"):
        module.set_activation_dtype(_activation_dtype)
    if hasattr(module, "set_batch_invariant"):
        module.set_batch_invariant(_batch_invariant)
