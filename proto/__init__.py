"""splitserve's public gRPC API (``splitserve.v1``): the .proto source and its
generated stubs (``splitserve_pb2``, ``splitserve_pb2_grpc``), committed.
``python -m splitserve.proto.generate`` regenerates them."""
