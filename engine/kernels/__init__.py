"""Optional native CPU kernels, compiled once on first use (cached by torch in
``~/.cache/torch_extensions``). Without a C++ compiler pdserve falls back to the plain torch path.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention_cpu.cpp")


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled module, or None when disabled (``PDSERVE_NATIVE_KERNELS=0``) or unbuildable."""
    if os.environ.get("PDSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="pdserve_paged_attention_cpu",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, unsupported platform
        log.warning("native CPU kernels unavailable, using the torch path: %s", exc)
        return None
