"""The committed stubs are exactly what `python -m pdserve.proto.generate` produces now."""

import subprocess
import sys

from pdserve.proto.generate import GENERATED, PROTO_DIR, REPO_ROOT


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    # In a child process: grpc_tools bundles its own protobuf runtime, and loading its
    # compiler into a process that already holds torch and grpc can crash it.
    subprocess.run(
        [sys.executable, "-m", "pdserve.proto.generate", str(tmp_path)],
        cwd=REPO_ROOT, check=True, capture_output=True, timeout=120,
    )
    stale = [
        name for name in GENERATED
        if (PROTO_DIR / name).read_bytes() != (tmp_path / "proto" / name).read_bytes()
    ]
    assert not stale, f"stubs out of date: {stale}; run `python -m pdserve.proto.generate`"


def test_generated_modules_import_as_package_proto():
    from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

    assert pdserve_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert hasattr(pdserve_pb2_grpc, "WorkerStub")
    assert hasattr(pdserve_pb2_grpc, "GenerationStub")


def test_declared_lower_bounds_are_what_the_stubs_check():
    """The stubs refuse to import under an older grpcio or protobuf than generated them:
    pyproject's lower bounds must not promise less (a GPU image with grpcio 1.84 once
    failed on stubs from 1.85)."""
    import re
    import tomllib

    from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = dict(re.fullmatch(r"([a-z-]+)>=([\d.]+)", d).groups() for d in deps if ">=" in d)
    grpc_needs = pdserve_pb2_grpc.GRPC_GENERATED_VERSION
    proto_needs = re.search(r"# Protobuf Python Version: ([\d.]+)",
                            (PROTO_DIR / "pdserve_pb2.py").read_text()).group(1)

    def at_least(bound: str, needed: str) -> bool:
        def parts(v):
            return tuple(map(int, (v + ".0.0").split(".")[:3]))
        return parts(bound) >= parts(needed)

    assert at_least(bounds["grpcio"], grpc_needs), (bounds["grpcio"], grpc_needs)
    assert at_least(bounds["protobuf"], proto_needs), (bounds["protobuf"], proto_needs)
    assert pdserve_pb2.DESCRIPTOR.package == "pdserve.v1"
