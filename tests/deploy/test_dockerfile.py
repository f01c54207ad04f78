"""``deploy/docker/Dockerfile`` agrees with the Helm chart and with the project.

The image is not built here (no registry is reachable from the build machines): the Dockerfile's
text is parsed and held to the chart's rendered defaults: the Ray base image of ``ray.version``,
the uid/gid of the pods' securityContext, the container ports, the cache paths the pods mount
writable, the default image reference; and to the project: the packages, the install steps of
``scripts/install.sh``, the functions the bake step calls.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from tests.support.helm_chart import (
    CHART,
    IMAGE_GID,
    IMAGE_HOME,
    IMAGE_UID,
    WRITABLE_PATHS,
    one,
    pod_specs,
    render,
)

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
BAKED_CACHE = "/opt/pdserve/cache"


@cache
def instructions() -> tuple[tuple[str, str], ...]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return tuple(out)


def args_of(keyword: str) -> list[str]:
    return [rest for key, rest in instructions() if key == keyword]


def arg_defaults() -> dict[str, str]:
    defaults: dict[str, str] = {}
    for rest in args_of("ARG"):
        name, _, value = rest.partition("=")
        if value:
            defaults[name] = value
    return defaults


def env() -> dict[str, str]:
    out: dict[str, str] = {}
    for rest in args_of("ENV"):
        for item in shlex.split(rest):
            key, _, value = item.partition("=")
            out[key] = value
    return out


def expand(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables[m.group(1) or m.group(2)], text)


@cache
def values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


@cache
def chart() -> dict[str, Any]:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def test_base_is_the_ray_image_of_the_charts_ray_version() -> None:
    (base,) = args_of("FROM")
    defaults = arg_defaults()
    assert base == "${BASE_IMAGE}"
    assert defaults["BASE_IMAGE"] == "rayproject/ray:${RAY_VERSION}-py311-cpu"
    assert defaults["RAY_VERSION"] == values()["ray"]["version"]
    cluster = one(render("defaults"), "RayCluster")["spec"]
    assert cluster["rayVersion"] == defaults["RAY_VERSION"]
    # The project's own Ray is pinned to the base image's, and checked after the install.
    (install,) = [r for r in args_of("RUN") if "pip install ." in r]
    assert '"ray[serve]==${RAY_VERSION}"' in install
    assert "ray.__version__ != '${RAY_VERSION}'" in install


def test_user_is_the_uid_and_gid_of_the_pods() -> None:
    users = args_of("USER")
    assert users[-1] == f"{IMAGE_UID}:{IMAGE_GID}", "the image must end on the non-root user"
    assert f"{IMAGE_UID}:{IMAGE_GID}" != "0:0"
    for copy in args_of("COPY"):
        assert copy.startswith(f"--chown={IMAGE_UID}:{IMAGE_GID} "), copy
    for role, pod in pod_specs(render("defaults")).items():
        context = pod["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"]) == (IMAGE_UID, IMAGE_GID), role
    assert values()["podSecurityContext"]["runAsUser"] == IMAGE_UID
    assert env()["HOME"] == IMAGE_HOME


def test_exposed_ports_are_the_charts_container_ports() -> None:
    exposed = {int(port) for rest in args_of("EXPOSE") for port in rest.split()}
    pods = pod_specs(render("defaults"))
    declared = {
        port["containerPort"]
        for role in ("coordinator", "head")
        for port in pods[role]["containers"][0]["ports"]
    }
    assert exposed == declared
    http = values()["msCoordinator"]["http_config"]
    assert {http[k] for k in ("predict_port", "manage_port", "status_port", "external_port")} <= (
        exposed
    )


def test_caches_live_where_the_chart_mounts_scratch_and_seeds_them() -> None:
    variables = env()
    caches = [variables["PDSERVE_CACHE_DIR"], variables["TORCH_EXTENSIONS_DIR"]]
    assert caches == [f"{IMAGE_HOME}/.cache/pdserve", f"{IMAGE_HOME}/.cache/torch_extensions"]
    assert set(caches) <= set(WRITABLE_PATHS)
    # The chart mounts an emptyDir over ~/.cache and seeds it from the baked copy.
    for role, pod in pod_specs(render("defaults")).items():
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        assert "emptyDir" in volumes[mounts[f"{IMAGE_HOME}/.cache"]], role
        if role != "head":
            seed = pod["initContainers"][0]["command"][-1]
            assert f"cp -a {BAKED_CACHE}/. {IMAGE_HOME}/.cache/;" in seed, role
    # The bake step moves exactly those caches to the baked copy.
    (bake,) = [r for r in args_of("RUN") if "load_model('bundled')" in r]
    assert f'mv "${{PDSERVE_CACHE_DIR}}" "${{TORCH_EXTENSIONS_DIR}}" {BAKED_CACHE}/' in bake
    assert any(f"mkdir -p {BAKED_CACHE}" in r and "chown" in r for r in args_of("RUN"))


def test_bake_step_calls_the_projects_loaders() -> None:
    (bake,) = [r for r in args_of("RUN") if "load_model('bundled')" in r]
    code = re.search(r'python -c "([^"]+)"', bake)
    assert code, bake
    tree = ast.parse(code.group(1))
    imported = {
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert imported == {
        ("engine.model.loader", "load_model"),
        ("engine.embedding_model", "EmbeddingModel"),
        ("engine.kernels", "cpu_kernels"),
        ("engine.kernels.quantized", "quantized_kernels"),
        ("engine.model.decode_layers", "decode_layer_kernels"),
    }
    for module, name in imported:
        source = ROOT / (module.replace(".", "/") + ".py")
        if not source.is_file():
            source = ROOT / module.replace(".", "/") / "__init__.py"
        defined = {
            node.name
            for node in ast.parse(source.read_text()).body
            if isinstance(node, ast.FunctionDef | ast.ClassDef)
        }
        assert name in defined, f"{module} defines no {name}"
    assert "assert cpu_kernels() is not None" in code.group(1)
    assert "assert quantized_kernels() is not None" in code.group(1)
    assert "assert decode_layer_kernels() is not None" in code.group(1)


def test_install_follows_scripts_install_sh() -> None:
    install_sh = (ROOT / "scripts" / "install.sh").read_text()
    runs = " ".join(args_of("RUN"))
    torch = re.search(r"pip install --quiet (torch==[\d.]+)", install_sh)
    assert torch
    assert f"torch=={arg_defaults()['TORCH_VERSION']}" == torch.group(1)
    for line in re.findall(r"pip install --quiet --no-deps (.+)", install_sh):
        assert f"pip install --no-deps {line.strip()}" in runs, line
    assert "pip install . " in runs  # the project itself, without the test extras
    # Every package of the project (and what its metadata needs) is copied in.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = " ".join(args_of("COPY"))
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert f" {package} ./{package}" in copied, package
    for needed in (
        "pyproject.toml",
        project["project"]["readme"],
        *project["project"]["license-files"],
    ):
        assert needed in copied, needed
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert f"!{pattern.rstrip('*')}/" in ignore


def test_image_reference_and_build_command_agree() -> None:
    version = chart()["appVersion"]
    (label,) = [r for r in args_of("LABEL") if "org.opencontainers.image.version" in r]
    labels = dict(item.split("=", 1) for item in shlex.split(label))
    assert labels["org.opencontainers.image.version"] == version
    image = f"{values()['image']['repository']}:{version}"
    deployment = one(render("defaults"), "Deployment")["spec"]["template"]["spec"]
    assert deployment["containers"][0]["image"] == image
    build = f"docker build -f deploy/docker/Dockerfile -t {image} ."
    assert build in DOCKERFILE.read_text()
    readme = (ROOT / "deploy" / "helm" / "README.md").read_text()
    assert build in readme
    assert "not built in CI" in readme


def root_run() -> str:
    """The RUN of the ``USER root`` section (the only one as root)."""
    keywords = list(instructions())
    start = keywords.index(("USER", "root"))
    (run,) = [rest for key, rest in keywords[start:] if key == "RUN"][:1]
    assert keywords[start + 1][0] == "RUN" and keywords[start + 2][0] == "USER"
    return run


def test_base_image_can_be_pinned_by_digest_and_release_builds_must() -> None:
    """A tag can be moved; BASE_IMAGE takes ``...@sha256:<digest>`` and REQUIRE_BASE_DIGEST=1
    makes the build refuse a tag (no registry is reachable here to learn the digest, so the
    default stays the tag)."""
    defaults = arg_defaults()
    assert defaults["REQUIRE_BASE_DIGEST"] == "0"
    text = DOCKERFILE.read_text()
    assert "--build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-cpu@sha256:<digest>" in text
    assert "--build-arg REQUIRE_BASE_DIGEST=1" in text
    assert 'org.opencontainers.image.base.name="${BASE_IMAGE}"' in " ".join(args_of("LABEL"))
    # The guard is the first command of the root RUN: run it with sh as the build would.
    guard = root_run().split(" && apt-get update")[0]
    for base, required, refused in (
        ("rayproject/ray:2.60.0-py311-cpu", "0", False),
        ("rayproject/ray:2.60.0-py311-cpu", "1", True),
        ("rayproject/ray:2.60.0-py311-cpu@sha256:" + "a" * 64, "1", False),
    ):
        variables = {"BASE_IMAGE": base, "REQUIRE_BASE_DIGEST": required}
        result = subprocess.run(
            ["sh", "-c", guard], env={**os.environ, **variables}, capture_output=True, timeout=10
        )
        assert (result.returncode != 0) == refused, (base, required, result.stderr)


def test_passwordless_sudo_of_the_ray_image_is_removed() -> None:
    run = root_run()
    for step in (
        "gpasswd -d ray sudo",
        "sed -i '/NOPASSWD/d' /etc/sudoers",
        "rm -f /etc/sudoers.d/ray*",
        "SUDO_FORCE_REMOVE=yes apt-get purge -y sudo",
        # and the build fails if anything of it is left
        "! command -v sudo",
        "! grep -rqs NOPASSWD /etc/sudoers /etc/sudoers.d",
        "! id -nG ray | grep -qw sudo",
    ):
        assert step in run, step
    # The purge comes after the last apt-get install, and nothing later runs as root.
    assert run.rindex("apt-get install") < run.index("apt-get purge -y sudo")
    assert [rest for key, rest in instructions() if key == "USER"] == ["root", "1000:100"]
    for run in args_of("RUN"):  # and no step runs sudo
        assert not re.search(r"(?:^|&&|;|\|\||\()\s*sudo\s", run), run


def _assert_the_constraints_are_in_place_before_the_first_pip_install() -> None:
    """``PIP_CONSTRAINT`` names the constraints file copied into the workdir, both before the
    first ``pip install``, and the build context lets the file through."""
    (arg,) = [r for r in args_of("ARG") if r.startswith("PIP_CONSTRAINT=")]
    target = arg.partition("=")[2]
    copy = f"--chown={IMAGE_UID}:{IMAGE_GID} deploy/docker/constraints.txt ./constraints.txt"
    assert copy in args_of("COPY")
    workdir = args_of("WORKDIR")[-1]
    assert target == f"{workdir}/constraints.txt"
    keywords = list(instructions())
    first_pip = next(i for i, (k, r) in enumerate(keywords) if k == "RUN" and "pip install" in r)
    assert keywords.index(("ARG", arg)) < first_pip
    assert keywords.index(("COPY", copy)) < first_pip
    assert "!deploy/docker/constraints.txt" in (DOCKER / "Dockerfile.dockerignore").read_text()


def _exact_pins(constraints: Path) -> dict[str, str]:
    """The constraints file's pins by name, every line asserted an exact ``name==version``."""
    pins = {}
    for line in constraints.read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[a-z0-9-]+", name) and re.fullmatch(r"[\w.]+", version)
            pins[name] = version
    return pins


def _assert_pdserves_requirements_are_pinned(pins: dict[str, str]) -> None:
    """Each of pyproject's dependencies pinned to a version it admits; install.sh's too."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for line in project["project"]["dependencies"]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in pins, name
        assert req.specifier.contains(pins[name], prereleases=True), (name, pins[name])
    for line in re.findall(
        r"pip install --quiet --no-deps (.+)", (ROOT / "scripts/install.sh").read_text()
    ):
        for package in line.split():
            assert canonicalize_name(package.split("==")[0]) in pins, package


def test_every_pip_install_is_constrained_to_the_tested_versions() -> None:
    constraints = DOCKER / "constraints.txt"
    _assert_the_constraints_are_in_place_before_the_first_pip_install()
    # Every line is an exact pin; torch and Ray at the image's versions; pdserve's own
    # requirements each pinned to a version they admit.
    pins = _exact_pins(constraints)
    defaults = arg_defaults()
    assert pins["torch"] == defaults["TORCH_VERSION"]
    assert pins["ray"] == defaults["RAY_VERSION"]
    _assert_pdserves_requirements_are_pinned(pins)
    # torch comes alone from its index (no dependency from there): its dependencies then come
    # from the main index at their pinned versions.
    (torch,) = [r for r in args_of("RUN") if "TORCH_INDEX_URL" in r]
    assert 'pip install --no-deps --index-url "${TORCH_INDEX_URL}"' in torch


def test_constraints_are_generated_from_this_environment() -> None:
    """``scripts/image_constraints.py --check``: the pins are this environment's versions, which
    ``scripts/install.sh`` installs with the same constraints."""
    install_sh = (ROOT / "scripts" / "install.sh").read_text()
    export = 'export PIP_CONSTRAINT="$PWD/deploy/docker/constraints.txt"'
    assert export in install_sh
    assert install_sh.index(export) < install_sh.index("pip install --quiet torch==")
    result = subprocess.run(
        [sys.executable, ROOT / "scripts" / "image_constraints.py", "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
