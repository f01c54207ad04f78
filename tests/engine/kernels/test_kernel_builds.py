"""How native kernels are built and found again: a finished build is imported with no lock and no
compiler, a build killed mid-way (its locks left behind) never stops the next start, and a wait for
a live builder is bounded and names the lock. Real builds through torch's extension loader, of a
one-function module that compiles in a second or two."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine import kernels
from tests.support.prerequisites import require

ROOT = Path(__file__).resolve().parents[3]
TINY_MODULE = """
#include <Python.h>
#define PDSERVE_CAT2(a, b) a##b
#define PDSERVE_CAT(a, b) PDSERVE_CAT2(a, b)
static PyObject *answer(PyObject *, PyObject *) { return PyLong_FromLong(%d); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, methods};
PyMODINIT_FUNC PDSERVE_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""


@pytest.fixture
def toolchain() -> None:
    missing = kernels.missing_toolchain()
    require(missing is None, f"{missing}: native modules cannot be built here")


@pytest.fixture
def tiny_source(tmp_path, monkeypatch) -> Path:
    """A module source of its own (a build root of its own, nothing cached in this process)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "_origins", {})
    source = tmp_path / "src" / "tiny_module.cpp"
    source.parent.mkdir()
    source.write_text(TINY_MODULE % (time.time_ns() % 1000))
    return source


def _python(code: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


NO_BUILD = """
    import fcntl, json, torch.utils.cpp_extension as ext
    def refuse(*args, **kwargs):
        raise AssertionError("a start with the module built must neither lock nor compile")
    ext.load = refuse
    fcntl.flock = refuse
    from engine import kernels
"""


def test_a_start_with_the_module_built_takes_no_lock_and_compiles_nothing(toolchain):
    """The real kernels, as every worker start and restart loads them: from the cached build."""
    from engine.kernels.quantized import quantized_kernels
    from engine.model.decode_layers import decode_layer_kernels

    for load in (kernels.cpu_kernels, quantized_kernels, decode_layer_kernels):
        assert load() is not None  # nothing to do where install.sh built them already
    done = _python(
        NO_BUILD
        + """
    from engine.kernels.quantized import quantized_kernels
    from engine.model.decode_layers import decode_layer_kernels
    for load in (kernels.cpu_kernels, quantized_kernels, decode_layer_kernels):
        assert load() is not None
    print(json.dumps(kernels.kernel_origins()))
    """,
        {},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    origins = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(origins) == {"paged_attention_cpu", "quantized_linear_cpu", "decode_layers_cpu"}
    assert set(origins.values()) == {"cached"}, origins


def test_a_build_is_reused_from_another_checkout(toolchain, tiny_source, tmp_path):
    module = kernels.build_extension(tiny_source)
    assert module.answer() == int(tiny_source.read_text().split("FromLong(")[1].split(")")[0])
    assert kernels.kernel_origins() == {"tiny_module": "built"}
    elsewhere = tmp_path / "other-checkout" / tiny_source.name
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(tiny_source.read_bytes())
    done = _python(
        NO_BUILD
        + f"""
    from pathlib import Path
    print(kernels.build_extension(Path({str(elsewhere)!r})).answer(), kernels.kernel_origins())
    """,
        {"TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[0] == str(module.answer())
    assert "'tiny_module': 'cached'" in done.stdout


def test_a_build_others_could_have_changed_is_built_again(toolchain, tiny_source, caplog):
    """A cached library made group-writable is not imported but rebuilt, with a warning saying
    why; the rebuilt one is its owner's alone again."""
    kernels.build_extension(tiny_source)
    folder = kernels.kernel_build_root() / kernels.module_name(tiny_source)
    library = folder / (folder / kernels.READY_FILE).read_text()
    library.chmod(0o775)
    kernels._loaded.clear()
    kernels.build_extension(tiny_source)
    assert kernels.kernel_origins() == {"tiny_module": "built"}
    assert f"the library {library} is writable by its group or by everyone" in caplog.text
    assert library.stat().st_mode & 0o022 == 0
    assert folder.stat().st_mode & 0o022 == 0


def _holding(lock: Path, meanwhile: str = "") -> subprocess.Popen:
    """A process holding the build lock ``lock`` (having run ``meanwhile`` under it), once it
    says so."""
    code = (
        "import time\nfrom pathlib import Path\nfrom engine import kernels\n"
        f"with kernels._build_lock(Path({str(lock)!r}), 1):{meanwhile}\n"
        "    print('held', flush=True)\n    time.sleep(120)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def _killed_mid_build(source: Path) -> None:
    """A process that took the build lock, started torch's build (its ``lock`` file written
    where today's and earlier layouts put it) and was killed with SIGKILL."""
    name = kernels.module_name(source)
    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    lock = root / "pdserve" / f"{name}.lock"
    stale = "".join(
        f"\n    Path({str(folder)!r}).mkdir(parents=True, exist_ok=True)"
        f"\n    (Path({str(folder)!r}) / 'lock').write_text('')"
        for folder in (root / "pdserve" / name, root / name)
    )
    holder = _holding(lock, stale)
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)


def test_a_build_killed_midway_does_not_stop_the_next_start(toolchain, tiny_source):
    _killed_mid_build(tiny_source)
    start = time.monotonic()
    done = _python(
        f"""
    from pathlib import Path
    from engine import kernels
    print(kernels.build_extension(Path({str(tiny_source)!r}), wait_s=30).answer())
    """,
        {"TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]},
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - start < 60  # a build of its own: seconds, not a wait on the dead


def test_a_wait_for_a_live_builder_is_bounded_and_names_the_lock(toolchain, tiny_source):
    lock = kernels.kernel_build_root() / f"{kernels.module_name(tiny_source)}.lock"
    holder = _holding(lock)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=f"{lock}.*held by pid {holder.pid}"):
            kernels.build_extension(tiny_source, wait_s=1)
        assert time.monotonic() - start < 5
    finally:
        holder.kill()
        holder.wait(10)
    assert kernels.build_extension(tiny_source, wait_s=5).answer() >= 0  # the lock is free again


def test_threads_loading_one_module_at_once_each_get_it_whole(toolchain):
    """Eight threads of a fresh process ask for the quantized kernels at the same moment, the GIL
    switching as often as it can: each gets the same module, every function in it. Loading one
    extension in two threads at once made CPython initialise it twice, concurrently, and some
    threads got a module missing functions (a worker whose ``ready`` found no ``isa``)."""
    done = _python(
        """
        import sys, threading
        sys.setswitchinterval(1e-6)
        from engine import kernels
        from engine.kernels.quantized import SOURCE
        barrier, modules = threading.Barrier(8), []

        def load():
            barrier.wait()
            modules.append(kernels.build_extension(SOURCE))

        threads = [threading.Thread(target=load) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        whole = all(hasattr(m, "isa") and hasattr(m, "avx512_probe") for m in modules)
        print(len(modules), len({id(m) for m in modules}), whole)
        """,
        {},
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["8", "1", "True"]
