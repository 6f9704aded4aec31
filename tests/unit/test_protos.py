"""The checked-in generated gRPC code matches what ``scripts/gen_protos.py`` makes from protos/ (not stale; the
generator is run in-process), and pyproject's protobuf floor is the runtime that code validates against."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import tomllib
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATED = ROOT / "lighthouse" / "v1"


def _gen_protos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_not_stale(tmp_path: pathlib.Path) -> None:
    written = _gen_protos().generate(tmp_path)
    assert written and all(p.is_file() and p.is_relative_to(tmp_path) for p in written)

    out = tmp_path / "lighthouse" / "v1"
    fresh = {p.relative_to(out).as_posix(): p for p in out.iterdir() if p.is_file()}
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


def test_protobuf_floor_is_the_runtime_the_generated_code_needs() -> None:
    """A fresh install that resolves an older protobuf than the generated code validates against fails at import."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = [m.group(1) for d in deps if (m := re.fullmatch(r"protobuf\s*>=\s*([0-9.]+)\s*(?:,.*)?", d.strip()))]
    assert len(floors) == 1, f"pyproject.toml names no single protobuf>= floor: {deps}"
    for generated in sorted(GENERATED.glob("*_pb2.py")):
        m = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
                      r"\s*(\d+),\s*(\d+),\s*(\d+),", generated.read_text())
        assert m, f"{generated.name} validates no protobuf runtime version"
        assert ".".join(m.groups()) == floors[0], (f"{generated.name} needs protobuf {'.'.join(m.groups())}, "
                                                  f"pyproject.toml allows >= {floors[0]}")
