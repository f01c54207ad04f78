"""Multimodal items: local paths only under allowed folders, types and sizes checked."""

from __future__ import annotations

import base64
import os

import pytest

from coordinator.api.errors import InputValidationError
from coordinator.api.media import MB, check_media


def _image(value: str) -> list[dict]:
    return [{"type": "image_url", "image_url": value}]


def test_local_file_under_an_allowed_folder(tmp_path):
    picture = tmp_path / "cat.png"
    picture.write_bytes(b"\x89PNG" + b"0" * 100)
    check_media(_image(str(picture)), (str(tmp_path),))


@pytest.mark.parametrize(
    "make_path, fragment",
    [
        (lambda d: "/etc/passwd.png", "must be a file under allowed_media_dirs"),
        (lambda d: str(d / ".." / "escape.png"), "must be a file under allowed_media_dirs"),
        (lambda d: str(d / "cat.gif"), "must be one of .jpg, .jpeg, .png"),
        (lambda d: str(d / "missing.png"), "names no file"),
    ],
)
def test_local_paths_that_are_refused(tmp_path, make_path, fragment):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.gif").write_bytes(b"GIF89a")
    with pytest.raises(InputValidationError) as error:
        check_media(_image(make_path(allowed)), (str(allowed),))
    assert fragment in str(error.value)


def test_symlink_out_of_the_folder_is_refused(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    outside = tmp_path / "secret.png"
    outside.write_bytes(b"x")
    os.symlink(outside, allowed / "link.png")
    with pytest.raises(InputValidationError, match="allowed_media_dirs"):
        check_media(_image(str(allowed / "link.png")), (str(allowed),))


def test_no_folder_configured_refuses_every_path(tmp_path):
    with pytest.raises(InputValidationError, match="none are configured"):
        check_media(_image(str(tmp_path / "a.png")), ())


def test_sizes(tmp_path):
    big = tmp_path / "big.png"
    with open(big, "wb") as file:
        file.truncate(20 * MB + 1)
    with pytest.raises(InputValidationError, match="at most 20 MB"):
        check_media(_image(str(big)), (str(tmp_path),))
    small_b64 = "data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8" * 100).decode()
    check_media(_image(small_b64), ())
    with pytest.raises(InputValidationError, match="not valid base64"):
        check_media(_image("data:image/jpeg;base64,@@@@"), ())
    check_media([{"type": "video_url", "video_url": "https://example.invalid/a.mp4"}], ())
