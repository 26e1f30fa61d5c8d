"""What travels to a GPU machine, and how it is put in place there. Standard library
only, run as a file (splitserve is not importable yet where it runs):

    python bench/device_prepare.py fetch      # a developer machine (a registry is reachable)
    python bench/device_prepare.py install    # the GPU machine, from the repo root

``fetch`` downloads the wheels the GPU image lacks (Python 3.12, x86_64: NIXL
for CUDA 13 and xxhash, the KV checksums' hash; the image has torch, Triton,
transformers, numpy and safetensors) into ``.device_wheels/`` (git ignores it;
the device call carries it), packs SmolLM2's tokenizer files beside them
(``tokenizer.tar.gz``, for the ``host_time`` stage's text; ``install`` unpacks it
into ``.device_site/tokenizer``), and prints the size of the tracked tree plus all
of it, which must stay under the 64 MiB a device call carries.

``install`` puts them into ``.device_site/`` (``pip --target``, no index, no
registry needed) and links this tree there as the ``splitserve`` package, as
``pyproject.toml``'s package map says (``public/`` is its ``__init__``), so that
``PYTHONPATH=.device_site python -m splitserve.bench.device_check --out DIR``
runs. The whole device call is in ``docs/gpu.md``.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".device_wheels"
SITE = ROOT / ".device_site"
TOKENIZER_ARCHIVE = WHEELS / "tokenizer.tar.gz"  # SmolLM2's tokenizer files (0.6 of 3.4 MiB packed)
TOKENIZER = SITE / "tokenizer"  # where install unpacks them, for bench.host_time there
LOCATE_SMOLLM2 = (
    "from splitserve.engine.model.loader import resolve_source; print(resolve_source('smollm2').directory)"
)
LIMIT_BYTES = 64 * 2**20
# name==version (pinned: the GPU image is fixed) of every wheel the image lacks
REQUIREMENTS = ("nixl-cu13==1.5.1", "xxhash==3.6.0")
TARGET = ("--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "--only-binary=:all:")


def fetch() -> int:
    WHEELS.mkdir(exist_ok=True)
    for requirement in REQUIREMENTS:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", *TARGET, "-d", str(WHEELS), requirement],
            check=True,
        )
    _pack_tokenizer()
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tree = sum((ROOT / name).stat().st_size for name in tracked.decode().split("\0") if name)
    wheels = sum(p.stat().st_size for p in WHEELS.glob("*") if p.is_file())
    total = tree + wheels
    print(
        f"tree {tree / 2**20:.1f} MiB + wheels {wheels / 2**20:.1f} MiB = {total / 2**20:.1f} MiB (limit 64)"
    )
    return 0 if total < LIMIT_BYTES else 1


def _pack_tokenizer() -> None:
    """SmolLM2's tokenizer files (no weights) packed into ``TOKENIZER_ARCHIVE``: the
    device check's ``host_time`` stage makes text with them (the GPU image has no
    model package). Here splitserve is installed; a machine without SmolLM2's
    package prints why and packs nothing."""
    where = subprocess.run([sys.executable, "-c", LOCATE_SMOLLM2], cwd=ROOT, capture_output=True, text=True)
    if where.returncode != 0:
        print(f"no SmolLM2 tokenizer packed (the host_time stage will say so): {where.stderr.strip()[-300:]}")
        return
    with tarfile.open(TOKENIZER_ARCHIVE, "w:gz") as tar:
        for f in sorted(Path(where.stdout.strip()).iterdir()):
            if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
                tar.add(f, arcname=f.name)


def install() -> int:
    SITE.mkdir(exist_ok=True)
    wheels = sorted(str(p) for p in WHEELS.glob("*.whl"))
    if wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--upgrade"]
            + ["--target", str(SITE), *wheels],
            check=True,
        )
    if TOKENIZER_ARCHIVE.exists():
        TOKENIZER.mkdir(exist_ok=True)
        with tarfile.open(TOKENIZER_ARCHIVE) as tar:
            tar.extractall(TOKENIZER, filter="data")
    package = SITE / "splitserve"
    package.mkdir(exist_ok=True)
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in folders.items():
        link = package / "__init__.py" if name == "splitserve" else package / name.removeprefix("splitserve.")
        target = ROOT / folder / "__init__.py" if name == "splitserve" else ROOT / folder
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    print(f"splitserve and {len(wheels)} wheels in {SITE}: PYTHONPATH={SITE}")
    return 0


if __name__ == "__main__":
    commands = {"fetch": fetch, "install": install}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    sys.exit(commands[sys.argv[1]]())
