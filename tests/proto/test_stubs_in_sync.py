"""The committed stubs are exactly what `python -m proto.generate` produces now."""

import subprocess
import sys

from proto.generate import GENERATED, PROTO_DIR, REPO_ROOT


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    # In a child process: grpc_tools bundles its own protobuf runtime, and loading its
    # compiler into a process that already holds torch and grpc can crash it.
    subprocess.run(
        [sys.executable, "-m", "proto.generate", str(tmp_path)],
        cwd=REPO_ROOT, check=True, capture_output=True, timeout=120,
    )
    stale = [
        name for name in GENERATED
        if (PROTO_DIR / name).read_bytes() != (tmp_path / "proto" / name).read_bytes()
    ]
    assert not stale, f"stubs out of date: {stale}; run `python -m proto.generate`"


def test_generated_modules_import_as_package_proto():
    from proto import pdserve_pb2, pdserve_pb2_grpc

    assert pdserve_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert hasattr(pdserve_pb2_grpc, "WorkerStub")
    assert hasattr(pdserve_pb2_grpc, "GenerationStub")
