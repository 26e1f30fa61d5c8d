"""The committed gRPC stubs are what the .proto generates today."""

import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.proto import generate


def test_committed_stubs_are_current(tmp_path):
    pytest.importorskip("grpc_tools")
    # In a child process: protoc's bundled protobuf crashes a process that has loaded much else.
    cmd = [sys.executable, "-m", "splitserve.proto.generate", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    fresh = [tmp_path / name for name in generate.OUTPUTS]
    stale = [p.name for p in fresh if p.read_bytes() != (Path(generate.HERE) / p.name).read_bytes()]
    assert not stale, f"stale stubs {stale}: run python -m splitserve.proto.generate and commit"


def test_stubs_import_as_a_package():
    from splitserve.proto import splitserve_pb2 as pb
    from splitserve.proto import splitserve_pb2_grpc as pb_grpc

    assert pb.DESCRIPTOR.package == "splitserve.v1"
    assert hasattr(pb_grpc, "SplitserveStub")
