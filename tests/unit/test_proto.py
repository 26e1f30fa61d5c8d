"""The committed gRPC stubs are what the .proto generates today."""

from pathlib import Path

import pytest

from splitserve.proto import generate


def test_committed_stubs_are_current(tmp_path):
    pytest.importorskip("grpc_tools")
    fresh = generate.generate(tmp_path)
    stale = [p.name for p in fresh if p.read_bytes() != (Path(generate.HERE) / p.name).read_bytes()]
    assert not stale, f"stale stubs {stale}: run python -m splitserve.proto.generate and commit"


def test_stubs_import_as_a_package():
    from splitserve.proto import splitserve_pb2 as pb
    from splitserve.proto import splitserve_pb2_grpc as pb_grpc

    assert pb.DESCRIPTOR.package == "splitserve.v1"
    assert hasattr(pb_grpc, "SplitserveStub")
