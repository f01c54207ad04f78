"""Checks of the media items of ``/infer`` inputs: where a file may come from and how big it is.

A value is a local path (only under ``allowed_media_dirs``, resolved, so ``..`` and symlinks
cannot leave them), an http(s) URL, or base64 (a ``data:`` URI or bare). Local files and base64
payloads are checked for type and size here; URLs are not fetched. A path the file system cannot
take (a NUL byte, a name that cannot be encoded) is refused like any invalid value (422).
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path

from coordinator.api.errors import InputValidationError

MB = 1024 * 1024
LIMITS = {  # type -> (allowed extensions, max bytes)
    "image_url": ((".jpg", ".jpeg", ".png"), 20 * MB),
    "video_url": ((".mp4", ".avi", ".wmv"), 512 * MB),
    "audio_url": ((".mp3", ".wav", ".flac"), 20 * MB),
}


def check_media(items: list[dict], allowed_dirs: tuple[str, ...]) -> None:
    for index, item in enumerate(items):
        kind = item["type"]
        value = item[kind]
        name = f"inputs[{index}].{kind}"
        if value.startswith(("http://", "https://")):
            continue
        if value.startswith("data:") or _looks_base64(value):
            _check_base64(name, kind, value)
            continue
        try:
            _check_local(name, kind, value, allowed_dirs)
        except (ValueError, UnicodeError, OSError) as exc:  # a NUL byte, an unencodable name
            raise InputValidationError(
                f"Parameter {name} must be a valid file path, an http(s) URL or base64, but got "
                f"{value[:200]!r}"
            ) from exc


def _looks_base64(value: str) -> bool:
    return len(value) >= 64 and "/" not in value[:1] and not os.path.splitext(value)[1]


def _check_base64(name: str, kind: str, value: str) -> None:
    data = value.split(",", 1)[1] if value.startswith("data:") else value
    try:
        size = len(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError) as exc:
        raise InputValidationError(f"Parameter {name} is not valid base64: {exc}") from None
    _check_size(name, size, LIMITS[kind][1])


def _check_local(name: str, kind: str, value: str, allowed_dirs: tuple[str, ...]) -> None:
    extensions, limit = LIMITS[kind]
    path = Path(value).resolve()
    roots = [Path(d).resolve() for d in allowed_dirs]
    if not any(path.is_relative_to(root) for root in roots):
        where = ", ".join(str(r) for r in roots) or "none are configured"
        raise InputValidationError(
            f"Parameter {name} must be a file under allowed_media_dirs ({where}), an http(s) "
            f"URL or base64, but got {value!r}"
        )
    if path.suffix.lower() not in extensions:
        raise InputValidationError(
            f"Parameter {name} must be one of {', '.join(extensions)}, but got {value!r}"
        )
    if not path.is_file():
        raise InputValidationError(f"Parameter {name} names no file: {value!r}")
    _check_size(name, path.stat().st_size, limit)


def _check_size(name: str, size: int, limit: int) -> None:
    if size > limit:
        raise InputValidationError(
            f"Parameter {name} must be at most {limit // MB} MB, but got {size} bytes"
        )
