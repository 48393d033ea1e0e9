"""Regenerate the checked-in protobuf/gRPC modules (``specdec/v1``) from ``proto/``.

Run ``python -m specdec.apps.protogen`` after editing a .proto file; a test regenerates into a
temporary folder and fails if the checked-in modules differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specdec.paths import SOURCE_ROOT

ROOT = SOURCE_ROOT
PROTO_DIR = ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted((PROTO_DIR / "specdec" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
    ] + [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> int:
    generate(ROOT)
    init = ROOT / "specdec" / "v1" / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated protobuf/gRPC modules (python -m specdec.apps.protogen). Do not edit."""\n')
    print(f"generated {len(proto_files())} protos into specdec/v1/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
