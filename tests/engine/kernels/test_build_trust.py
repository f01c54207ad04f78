"""Which cached kernel builds may be imported (``engine/kernels/build_trust.py``): only a library
directly inside its build folder, both owned by this user and writable by no one else. Temporary
folders stand in for builds: the check reads names, owners and modes, never the library."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.kernels import build_trust
from engine.kernels.build_trust import make_private, untrusted_reason

LIBRARY = "pdserve_tiny_0123.so"


@pytest.fixture
def build(tmp_path) -> Path:
    """A build folder (mode 0755) holding a library (mode 0755), as a private build leaves it."""
    folder = tmp_path / "pdserve" / "pdserve_tiny_0123"
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    (folder / LIBRARY).write_bytes(b"\x7fELF")
    (folder / LIBRARY).chmod(0o755)
    return folder


def test_a_private_build_is_trusted(build):
    assert untrusted_reason(build, LIBRARY) is None


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "not a library file name"),
        ("..", "not a library file name"),
        ("../pdserve_tiny_0123/" + LIBRARY, "not a library file name"),
        ("sub/" + LIBRARY, "a path rather than a file of the folder"),
        ("/tmp/" + LIBRARY, "a path rather than a file of the folder"),
    ],
)
def test_a_ready_file_naming_anything_but_a_file_name_is_refused(build, name, reason):
    assert reason in untrusted_reason(build, name)


def test_a_library_linked_from_elsewhere_is_refused(build, tmp_path):
    planted = tmp_path / "planted.so"
    planted.write_bytes(b"\x7fELF")
    (build / "linked.so").symlink_to(planted)
    assert "outside its build folder" in untrusted_reason(build, "linked.so")
    (build / "alias.so").symlink_to(build / LIBRARY)
    assert "is a link" in untrusted_reason(build, "alias.so")


def test_a_build_folder_that_is_a_link_is_refused(build, tmp_path):
    link = tmp_path / "linked-build"
    link.symlink_to(build)
    assert "build folder" in untrusted_reason(link, LIBRARY)
    assert "is a link" in untrusted_reason(link, LIBRARY)


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777])
def test_a_library_others_may_write_is_refused(build, mode):
    (build / LIBRARY).chmod(mode)
    reason = untrusted_reason(build, LIBRARY)
    assert f"the library {build / LIBRARY} is writable by its group or by everyone" in reason
    assert oct(mode) in reason


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o1777])
def test_a_folder_others_may_write_is_refused(build, mode):
    build.chmod(mode)
    reason = untrusted_reason(build, LIBRARY)
    assert f"the build folder {build} is writable by its group or by everyone" in reason


def test_a_build_of_another_user_is_refused(build, monkeypatch):
    owner = os.geteuid()
    monkeypatch.setattr(build_trust.os, "geteuid", lambda: owner + 1)
    reason = untrusted_reason(build, LIBRARY)
    assert f"the build folder {build} is owned by uid {owner}, not this user" in reason


def test_a_missing_library_is_refused(build):
    assert "cannot be read" in untrusted_reason(build, "gone.so")


def test_make_private_drops_group_and_world_write_only(build):
    (build / LIBRARY).chmod(0o777)
    make_private(build / LIBRARY)
    assert (build / LIBRARY).stat().st_mode & 0o7777 == 0o755
    assert untrusted_reason(build, LIBRARY) is None
