import subprocess
import sys
from pathlib import Path

import pytest
from infergate.policies import PolicyError, load_policy, parse_policy
from infergate.policies.demo import demo_policy, example_text
from infergate.policies.loader import digest

from tests.helpers import as_yaml, policy, policy_yaml

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
    doc = policy()
    doc["tiers"]["enterprise"]["deadline_ms"] = "soon"
    text = as_yaml(doc)
    [problem] = _problems(text)
    line = text.splitlines().index("    deadline_ms: soon") + 1
    assert problem.startswith(
        f"p.yaml:{line}: tiers.enterprise.deadline_ms: Expected `int`, got `str`"
    )
    assert "write a whole number" in problem


def test_unknown_field_points_at_the_field() -> None:
    doc = policy()
    doc["batching"]["max_batch_sise"] = doc["batching"].pop("max_batch_size")
    text = as_yaml(doc)
    [problem] = _problems(text)
    line = text.splitlines().index("  max_batch_sise: 100") + 1
    assert problem.startswith(
        f"p.yaml:{line}: batching.max_batch_sise: Object contains unknown field"
    )


def test_semantic_problems_are_all_reported() -> None:
    doc = policy(tiers={"enterprise": {"rate_limits": ["10/minuet"]}})
    doc["keys"][1]["tier"] = "gold"
    doc["keys"][2]["sha256"] = "not-a-digest"
    problems = _problems(as_yaml(doc))
    assert any(
        "tiers.enterprise.rate_limits[0]: '10/minuet' is not a rate; write e.g." in p
        for p in problems
    )
    assert any("keys[1].tier: unknown tier 'gold'" in p for p in problems)
    assert any(
        "keys[2].sha256: must be the 64-character lowercase hex SHA-256" in p for p in problems
    )


def test_a_limit_that_admits_nothing_is_refused() -> None:
    """A limit of 0 would refuse every request, each told to retry: the
    policy says to disable the key instead, for every kind of limit."""
    doc = policy(tiers={"paid": {"rate_limits": ["0/second"], "cost_limit": "0/minute"}})
    doc["keys"][0]["token_limits"] = ["10/second", "0/hour"]
    problems = _problems(as_yaml(doc))
    for where, rate in (
        ("tiers.paid.rate_limits[0]", "0/second"),
        ("tiers.paid.cost_limit", "0/minute"),
        ("keys[0].token_limits[1]", "0/hour"),
    ):
        assert any(
            f"{where}: '{rate}' admits nothing: a limit is at least 1" in p for p in problems
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
    doc = policy()
    doc["keys"][1]["tier"] = "gold"
    bad.write_text(as_yaml(doc))
    res = subprocess.run(
        [sys.executable, "-m", "infergate", "policy", "check", str(bad)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1
    assert f"{bad}:" in res.stderr
    assert "keys[1].tier: unknown tier 'gold'" in res.stderr


def test_a_tier_whose_longest_input_cannot_fit_a_body_is_refused() -> None:
    # 16,384 four-byte characters are 65,536 bytes before the JSON around
    # them: a 65,536-byte body limit would 413 inputs the tier allows.
    doc = policy(tiers={"enterprise": {"max_input_chars": 16_384}})
    doc["limits"]["max_body_bytes"] = 65_536
    [problem] = _problems(as_yaml(doc))
    assert "limits.max_body_bytes: tier 'enterprise' allows 16384 characters" in problem
    assert "at least 66560" in problem
    doc["limits"]["max_body_bytes"] = 66_560
    parse_policy(as_yaml(doc), "p.yaml")


@pytest.mark.parametrize("mark", [0.4, 1.5, float("nan"), float("inf")])
def test_a_redis_memory_high_water_mark_outside_half_to_one_is_refused(mark: float) -> None:
    [problem] = _problems(as_yaml(policy(limits={"redis_memory_high_water": mark})))
    assert "limits.redis_memory_high_water: must be between 0.5 and 1" in problem
    parse_policy(as_yaml(policy(limits={"redis_memory_high_water": 1.0})), "p.yaml")


def test_a_key_written_twice_in_one_mapping_is_refused() -> None:
    """YAML keeps the last of two, silently: `disabled: true` above a
    `disabled: false` would leave the key working."""
    text = policy_yaml().replace("  disabled: true\n", "  disabled: true\n  disabled: false\n")
    assert "disabled: false" in text
    [problem] = _problems(text)
    line = text.splitlines().index("  disabled: false") + 1
    assert problem.startswith(f"p.yaml:{line}: ")
    assert "'disabled' is written twice; keep one" in problem


def test_weights_and_usage_retention_are_checked() -> None:
    doc = policy()
    doc["keys"][0]["weight"] = 0
    doc["usage"] = {"retention_days": 401}
    problems = _problems(as_yaml(doc))
    assert any("keys[0].weight: must be between 0.01 and 1000" in p for p in problems)
    assert any("usage.retention_days: must be between 1/24" in p for p in problems)


async def test_an_edit_in_place_that_keeps_size_and_mtime_is_still_taken(tmp_path: Path) -> None:
    """The watcher reads the file only when its stat moved: an edit of the
    same size whose mtime is set back (an editor that keeps it, or a copy
    with -p) still moves its ctime, and is taken."""
    import os

    from infergate.policies.live import LivePolicy

    path = tmp_path / "policy.yaml"
    before = policy_yaml(max_batch_size=50)
    after = policy_yaml(max_batch_size=60)
    assert len(before) == len(after)
    path.write_text(before)
    live = LivePolicy(parse_policy(before), str(path), text=before)
    assert not await live.check_file()  # (as when last read: nothing to take)
    stat = path.stat()
    with path.open("r+") as f:  # in place: the same inode
        f.write(after)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert not await live.check_file()  # changed: taken once it reads the same again
    assert await live.check_file()
    assert live.current.document.batching.max_batch_size == 60


async def test_the_watcher_polls_twice_a_second_and_faster_while_an_edit_settles(
    tmp_path: Path,
) -> None:
    from infergate.policies.live import SETTLE_S, LivePolicy

    path = tmp_path / "policy.yaml"
    before, after = policy_yaml(max_batch_size=50), policy_yaml(max_batch_size=60)
    path.write_text(before)
    live = LivePolicy(parse_policy(before), str(path), text=before)
    assert not await live.check_file()
    assert live.loop.interval_s == 0.5  # at rest
    path.write_text(after)
    assert not await live.check_file()  # changed: read again once it stayed so
    assert live.loop.interval_s == SETTLE_S == 0.25
    assert await live.check_file()
    assert live.loop.interval_s == 0.5
