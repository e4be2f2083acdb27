"""`warmbox doctor --security` names real attack tests, and every attack test backs a guarantee."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from tests.conftest import cli
from warmbox.cli.security import GUARANTEES

ATTACKS = Path(__file__).parent / "attacks"


def _attack_tests() -> set[str]:
    out = set()
    for f in ATTACKS.glob("test_*.py"):
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                out.add(f"{f.name}::{node.name}")
    return out


def test_every_named_proof_exists_and_every_attack_test_is_named():
    named = [t for g in GUARANTEES for t in g.tests]
    existing = _attack_tests()
    assert not set(named) - existing, f"guarantees name missing tests: {sorted(set(named) - existing)}"
    assert not existing - set(named), f"attack tests no guarantee names: {sorted(existing - set(named))}"
    assert all(g.tiers and g.claim for g in GUARANTEES)


def test_doctor_security_prints_them():
    r = cli("doctor", "--security", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == len(GUARANTEES) and all(row["tests"] for row in rows)
    text = cli("doctor", "--security").stdout
    assert "proof: tests/attacks/test_host_paths.py::test_resume_trigger_never_follows_a_planted_symlink" in text
