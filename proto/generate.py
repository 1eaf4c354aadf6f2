"""Regenerates the Python stubs for `proto/pdserve.proto` with grpcio-tools.

`python -m proto.generate` rewrites `proto/<name>_pb2.py`, `<name>_pb2.pyi` and
`<name>_pb2_grpc.py` of every proto in place (`pdserve.proto`: the wire protocol;
`testing.proto`: the test-only gates). The proto is compiled with the repository root as include
path, so the generated gRPC module imports `from proto import pdserve_pb2` and the stubs
work from an editable install. `tests/proto/test_stubs_in_sync.py` fails when the committed
stubs differ from a fresh generation.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent
PROTO_FILES = ["proto/pdserve.proto", "proto/testing.proto"]
GENERATED = [f"{Path(f).stem}{suffix}" for f in PROTO_FILES
             for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def generate(out_root: Path = REPO_ROOT) -> list[Path]:
    """Compile the protos so that the stubs land in `out_root/proto/`; return their paths."""
    import grpc_tools
    from grpc_tools import protoc

    out_root = Path(out_root)
    (out_root / "proto").mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(REPO_ROOT / f) for f in PROTO_FILES],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return [out_root / "proto" / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    """`python -m proto.generate [OUT_ROOT]`: write the stubs under OUT_ROOT/proto/
    (default: this repository)."""
    argv = sys.argv[1:] if argv is None else argv
    out_root = Path(argv[0]) if argv else REPO_ROOT
    for path in generate(out_root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
