"""The checked-in generated code matches what scripts/gen_protos.py makes from protos/ (not stale)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATED = ROOT / "lighthouse" / "v1"


def test_generated_code_is_not_stale(tmp_path: pathlib.Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    written = sorted(pathlib.Path(line) for line in out.stdout.split())
    assert written and all(p.is_file() and p.is_relative_to(tmp_path) for p in written)

    fresh = {p.relative_to(tmp_path / "lighthouse" / "v1").as_posix(): p for p in (tmp_path / "lighthouse" / "v1").iterdir()
             if p.is_file()}
    checked_in = {p.name: p for p in GENERATED.glob("*_pb2*.py*")}
    assert sorted(fresh) == sorted(checked_in), "generated files added or removed: run `make proto`"
    stale = [name for name, p in fresh.items() if p.read_bytes() != checked_in[name].read_bytes()]
    assert not stale, f"stale generated code {stale}: run `make proto` (scripts/gen_protos.py)"


def test_every_proto_has_generated_code() -> None:
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    assert protos
    for proto in protos:
        stem = proto.relative_to(ROOT / "protos").with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert (ROOT / f"{stem}{suffix}").is_file(), f"{stem}{suffix} missing"
