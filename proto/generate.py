"""Regenerates the Python stubs for `proto/pdserve.proto` with grpcio-tools.

`python -m pdserve.proto.generate` rewrites `proto/<name>_pb2.py`, `<name>_pb2.pyi` and
`<name>_pb2_grpc.py` of every proto in place (`pdserve.proto`: the wire protocol;
`testing.proto`: the test-only gates). The protos are compiled from a staging tree that
places them at `pdserve/proto/`, their path once installed, so the generated gRPC module
imports `from pdserve.proto import pdserve_pb2`. `tests/proto/test_stubs_in_sync.py` fails when the committed
stubs differ from a fresh generation.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent
PROTO_FILES = ["pdserve.proto", "testing.proto"]
GENERATED = [f"{Path(f).stem}{suffix}" for f in PROTO_FILES
             for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def generate(out_root: Path = REPO_ROOT) -> list[Path]:
    """Compile the protos so that the stubs land in `out_root/proto/`; return their paths."""
    import grpc_tools
    from grpc_tools import protoc

    out_root = Path(out_root)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as staging:
        staged = Path(staging) / "pdserve" / "proto"
        staged.mkdir(parents=True)
        for name in PROTO_FILES:
            shutil.copy(PROTO_DIR / name, staged / name)
        args = [
            "grpc_tools.protoc",
            f"-I{staging}",
            f"-I{well_known}",
            f"--python_out={staging}",
            f"--pyi_out={staging}",
            f"--grpc_python_out={staging}",
            *[str(staged / name) for name in PROTO_FILES],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        (out_root / "proto").mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copy(staged / name, out_root / "proto" / name)
    return [out_root / "proto" / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.proto.generate [OUT_ROOT]`: write the stubs under OUT_ROOT/proto/
    (default: this repository)."""
    argv = sys.argv[1:] if argv is None else argv
    out_root = Path(argv[0]) if argv else REPO_ROOT
    for path in generate(out_root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
