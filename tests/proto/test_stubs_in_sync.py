"""The committed stubs are exactly what `python -m proto.generate` produces now."""

from proto.generate import GENERATED, PROTO_DIR, generate


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    fresh = generate(tmp_path)
    stale = [
        name
        for name, path in zip(GENERATED, fresh)
        if (PROTO_DIR / name).read_bytes() != path.read_bytes()
    ]
    assert not stale, f"stubs out of date: {stale}; run `python -m proto.generate`"


def test_generated_modules_import_as_package_proto():
    from proto import pdserve_pb2, pdserve_pb2_grpc

    assert pdserve_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert hasattr(pdserve_pb2_grpc, "WorkerStub")
    assert hasattr(pdserve_pb2_grpc, "GenerationStub")
