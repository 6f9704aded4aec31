"""Generate the Python gRPC code from protos/ into the package tree (``lighthouse/v1/*_pb2*.py``; the wire package
stays ``fthsdp.v1``).

Usage: ``python scripts/gen_protos.py [--out DIR]``. With ``--out`` it writes elsewhere (the staleness test
generates into a temporary folder and compares).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc (grpc_tools) on every .proto under protos/; return the files written."""
    import grpc_tools
    from grpc_tools import protoc

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *files]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    stems = [out / f[: -len(".proto")] for f in files]
    return [pathlib.Path(f"{stem}{suffix}") for stem in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    written = generate(parser.parse_args().out)
    for p in written:
        print(p)


if __name__ == "__main__":
    sys.exit(main())
