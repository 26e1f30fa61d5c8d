"""Regenerate the committed Python stubs from ``splitserve.proto``.

    python -m splitserve.proto.generate            # rewrites proto/splitserve_pb2*.py[i]
    python -m splitserve.proto.generate --out DIR  # writes them elsewhere (the staleness test)

Needs ``grpcio-tools`` (in the ``test`` extra). The stubs are generated as if
the .proto lived at ``splitserve/proto/`` so that they import each other as
``splitserve.proto.*``, which is where pyproject installs this folder.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "splitserve.proto"
OUTPUTS = ("splitserve_pb2.py", "splitserve_pb2.pyi", "splitserve_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs into ``out_dir``; return their paths."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-Isplitserve/proto={HERE}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"splitserve/proto/{PROTO}",
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {HERE / PROTO}")
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for name in OUTPUTS:
            dst = out_dir / name
            shutil.copyfile(Path(tmp) / "splitserve" / "proto" / name, dst)
            paths.append(dst)
        return paths


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[1]) if len(args) == 2 and args[0] == "--out" else HERE
    for path in generate(out):
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
