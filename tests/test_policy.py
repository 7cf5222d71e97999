import subprocess
import sys
from pathlib import Path

import pytest
from infergate.policies import PolicyError, load_policy, parse_policy
from infergate.policies.demo import demo_policy, example_text
from infergate.policies.loader import digest

from tests.helpers import policy_yaml

EXAMPLE = Path(__file__).parent.parent / "policies" / "example.yaml"


def test_example_policy_is_valid() -> None:
    policy = load_policy(EXAMPLE)
    assert list(policy.tiers) == ["enterprise", "paid", "free"]
    assert any(k.disabled for k in policy.document.keys)
    assert len(policy.version) == 12


def test_demo_policy_is_the_example_with_fresh_keys() -> None:
    text, keys = demo_policy()
    policy = parse_policy(text, "demo.yaml")
    assert set(keys) == {"enterprise", "paid", "free"}
    for tier, secret in keys.items():
        entry = policy.key_for_digest(digest(secret))
        assert entry is not None
        assert entry.tier == tier
    assert policy.document.tiers == parse_policy(example_text()).document.tiers
    assert secret not in text


def _problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    return [str(p) for p in info.value.problems]


def test_errors_name_file_line_path_and_fix() -> None:
    text = policy_yaml().replace("deadline_ms: 10000", "deadline_ms: soon", 1)
    [problem] = _problems(text)
    assert problem.startswith("p.yaml:3: tiers.enterprise.deadline_ms: Expected `int`, got `str`")
    assert "write a whole number" in problem


def test_unknown_field_points_at_the_field() -> None:
    text = policy_yaml().replace("  max_batch_size:", "  max_batch_sise:")
    [problem] = _problems(text)
    line = text.splitlines().index("  max_batch_sise: 100") + 1
    assert problem.startswith(
        f"p.yaml:{line}: batching.max_batch_sise: Object contains unknown field"
    )


def test_semantic_problems_are_all_reported() -> None:
    text = (
        policy_yaml(tiers_extra="    rate_limits: ['10/minuet']\n")
        .replace("tier: paid", "tier: gold")
        .replace("sha256: " + digest("test-free-secret"), "sha256: not-a-digest")
    )
    problems = _problems(text)
    assert any(
        "tiers.enterprise.rate_limits[0]: '10/minuet' is not a rate; write e.g." in p
        for p in problems
    )
    assert any("keys[1].tier: unknown tier 'gold'" in p for p in problems)
    assert any(
        "keys[2].sha256: must be the 64-character lowercase hex SHA-256" in p for p in problems
    )


def test_missing_tier_and_bad_yaml() -> None:
    assert any(
        "missing tier(s) free" in p for p in _problems("tiers:\n  enterprise: {}\n  paid: {}\n")
    )
    assert "not valid YAML" in _problems("tiers: [\n")[0]


def test_policy_check_cli(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(policy_yaml())
    ok = subprocess.run(
        [sys.executable, "-m", "infergate", "policy", "check", str(good)],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0
    assert "ok: version" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(policy_yaml().replace("tier: paid", "tier: gold"))
    res = subprocess.run(
        [sys.executable, "-m", "infergate", "policy", "check", str(bad)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1
    assert f"{bad}:" in res.stderr
    assert "keys[1].tier: unknown tier 'gold'" in res.stderr
