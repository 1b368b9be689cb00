"""The committed generated code is exactly what ``python -m shared.protogen`` produces."""

from __future__ import annotations

from pathlib import Path

from shared import protogen


def test_generated_code_in_sync(tmp_path: Path) -> None:
    protogen.generate(tmp_path)
    fresh = tmp_path / "kvmesh" / "v1"
    committed = protogen.OUT_ROOT / "kvmesh" / "v1"
    fresh_names = sorted(p.name for p in fresh.iterdir())
    committed_names = sorted(p.name for p in committed.iterdir() if p.name != "__pycache__")
    assert fresh_names == committed_names
    stale = [n for n in fresh_names if (fresh / n).read_text() != (committed / n).read_text()]
    assert stale == [], f"run `make proto`: out of date: {stale}"


def test_every_field_has_a_comment() -> None:
    """Every message field and rpc in the protos carries a ``//`` comment on the line above."""
    missing: list[str] = []
    for proto in sorted(protogen.PROTO_ROOT.glob("kvmesh/v1/*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            is_field = s.endswith(";") and "=" in s and not s.startswith(("syntax", "option", "//"))
            is_rpc = s.startswith("rpc ")
            if (is_field or is_rpc) and not lines[i - 1].strip().startswith("//"):
                missing.append(f"{proto.name}:{i + 1}: {s}")
    assert missing == []


def test_imports_are_rerooted() -> None:
    from shared.pb.kvmesh.v1 import scheduler_pb2

    assert scheduler_pb2.DESCRIPTOR.package == "kvmesh.v1"
    text = (protogen.OUT_ROOT / "kvmesh" / "v1" / "scheduler_pb2.py").read_text()
    assert "from kvmesh.v1" not in text
