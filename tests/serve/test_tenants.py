"""The tenants file as operators write it: the issue's example, every problem named with its line, keys matched
in constant time, `service_tier` granted only downwards, reloads that keep the old tenants when the file breaks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from serve.tenancy.tenants import (
    ANONYMOUS,
    DEFAULT_MAX_SESSIONS,
    Caller,
    SharedPrefix,
    Tenants,
    TenantsError,
    TenantsSource,
    load_tenants,
    parse_tenants,
)

EXAMPLE = """\
[tenants.acme]
keys = ["key-tenant-a"]
tier = "priority"
requests_per_minute = 600

[tenants.globex]
keys = ["key-tenant-b"]
tier = "free"
requests_per_minute = 8
"""


def test_the_issue_example_parses_with_the_builtin_tiers() -> None:
    tenants = parse_tenants(EXAMPLE, "tenants.toml")
    assert [t.name for t in tenants.tiers] == ["priority", "standard", "free"]
    acme, globex = tenants.tenants
    assert (acme.name, acme.tier.name, acme.limits.requests_per_minute) == ("acme", "priority", 600.0)
    assert (globex.name, globex.tier.rank, globex.limits.requests_per_minute) == ("globex", 2, 8.0)
    assert tenants.authenticate(b"key-tenant-a") is acme
    assert tenants.authenticate(b"key-tenant-b") is globex
    for wrong in (b"key-tenant-c", b"key-tenant-a ", b"", None):
        assert tenants.authenticate(wrong) is None
    assert "key-tenant" not in repr(tenants)  # digests and keys never printed


def test_keys_may_be_given_as_digests_and_json_works_too(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"s3cret-key").hexdigest()
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {"acme": {"key_sha256": [digest], "tokens_per_minute": 1000}}}))
    tenants = load_tenants(path)
    assert tenants.authenticate(b"s3cret-key").name == "acme"  # type: ignore[union-attr]
    assert tenants.tenants[0].tier.name == "standard"  # the default tier
    assert tenants.tenants[0].limits.tokens_per_minute == 1000.0


def test_every_problem_is_named_with_its_line_at_once() -> None:
    broken = """\
[tenants.acme]
keys = ["key-a"]
tier = "gold"
requests_per_minute = -3

[tenants.globex]
keys = ["key-a"]
colour = "blue"

[tenants.initech]
max_tokens = 1.5
"""
    with pytest.raises(TenantsError) as raised:
        parse_tenants(broken, "t.toml")
    message = str(raised.value)
    assert "\n" not in message and message.endswith("fix the file")
    for expected in (
        "line 3: tenants.acme.tier must be one of priority, standard, free (got 'gold')",
        "line 4: tenants.acme.requests_per_minute must be positive (got -3)",
        "line 8: tenants.globex.colour is not a tenant setting",
        "line 10: tenants.initech has no key",
        "line 11: tenants.initech.max_tokens must be an integer (got 1.5)",
    ):
        assert expected in message, (expected, message)


def test_a_key_held_by_two_tenants_is_refused() -> None:
    twice = '[tenants.a]\nkeys = ["same-key"]\n[tenants.b]\nkeys = ["same-key"]\n'
    with pytest.raises(TenantsError, match=r"line 4: tenants\.b\.keys holds a key tenant 'a' holds too"):
        parse_tenants(twice, "t.toml")


def test_syntax_errors_name_their_line() -> None:
    with pytest.raises(TenantsError, match=r"at line 2, column \d+\); fix the TOML"):
        parse_tenants('[tenants.a]\nkeys = "x\ntier = "free"\n', "t.toml")
    with pytest.raises(TenantsError, match=r"at line 2, the end of the file\); fix the TOML"):
        parse_tenants('[tenants.a]\nkeys = ["x"\n', "t.toml")
    with pytest.raises(TenantsError, match=r"line 2: .*fix the JSON"):
        parse_tenants('{"tenants":\n  {"a": ]}', "t.json", "json")
    with pytest.raises(TenantsError, match=r"line 4: expected .*fix the YAML"):
        parse_tenants("tenants:\n  a:\n    keys: [x\n", "t.yaml", "yaml")
    with pytest.raises(TenantsError, match=r"keys must be strings, not tenants\.123"):
        parse_tenants("tenants:\n  123:\n    keys: [x]\n", "t.yaml", "yaml")


def test_service_tier_lowers_the_tier_never_raises_it() -> None:
    tenants = parse_tenants(EXAMPLE, "t.toml")
    acme, globex = tenants.tenants
    assert tenants.caller(acme, None).service_tier == "priority"
    assert tenants.caller(acme, "auto").tier == "priority"
    lowered = tenants.caller(acme, "flex")
    assert (lowered.tier, lowered.tier_rank, lowered.service_tier) == ("free", 2, "flex")
    assert tenants.caller(acme, "default").tier == "standard"
    asked_up = tenants.caller(globex, "priority")  # downgraded to its own tier, and the answer says so
    assert (asked_up.tier, asked_up.service_tier) == ("free", "flex")
    assert tenants.caller(globex, "default").tier == "free"


def test_custom_tiers_in_order_and_their_openai_names() -> None:
    text = """\
[[tiers]]
name = "gold"
service_tier = "priority"
[[tiers]]
name = "silver"
[[tiers]]
name = "bronze"
service_tier = "flex"

[tenants.a]
keys = ["ka"]
tier = "silver"
"""
    tenants = parse_tenants(text, "t.toml")
    assert [(t.name, t.rank, t.service_tier) for t in tenants.tiers] == [
        ("gold", 0, "priority"),
        ("silver", 1, "default"),
        ("bronze", 2, "flex"),
    ]
    a = tenants.tenants[0]
    assert tenants.caller(a, "priority").tier == "silver"
    assert tenants.caller(a, "flex").tier == "bronze"
    with pytest.raises(TenantsError, match=r"line 3: tiers\.gold\.service_tier must be one of"):
        parse_tenants('[[tiers]]\nname = "gold"\nservice_tier = "fast"\n' + EXAMPLE, "t.toml")


def test_api_keys_join_as_the_default_tenant() -> None:
    tenants = parse_tenants(EXAMPLE, "t.toml", api_keys=("legacy-key",))
    legacy = tenants.authenticate(b"legacy-key")
    assert legacy is not None and (legacy.name, legacy.tier.name) == ("default", "standard")
    with pytest.raises(TenantsError, match="tenant of `--api-key` keys"):
        parse_tenants('[tenants.default]\nkeys = ["k"]\n', "t.toml", api_keys=("legacy-key",))
    with pytest.raises(TenantsError, match="holds a key tenant 'acme' holds too"):
        parse_tenants(EXAMPLE, "t.toml", api_keys=("key-tenant-a",))
    keyed = Tenants.with_keys(["k1", "k2"])
    assert keyed.authenticate(b"k2").name == "default" and keyed.authenticate(b"k3") is None  # type: ignore[union-attr]
    assert Tenants().open and Tenants().authenticate(None) is ANONYMOUS


def test_shared_prefixes_are_matched_by_digest_and_only_for_their_tenants() -> None:
    text = (
        EXAMPLE
        + '[tenants.initech]\nkeys = ["key-c"]\n\n[shared_prefixes.support]\ntext = "You help."\ntenants = ["acme", "globex"]\n'
    )
    tenants = parse_tenants(text, "t.toml")
    acme, globex, initech = tenants.tenants
    assert [p.name for p in acme.shared_prefixes] == ["support"] == [p.name for p in globex.shared_prefixes]
    assert initech.shared_prefixes == ()
    prefix = acme.shared_prefixes[0]
    assert prefix.matches("You help. And more") and prefix.matches("You help.")
    assert not prefix.matches("You help") and not prefix.matches("You halp. And more")
    with pytest.raises(TenantsError, match="names tenant 'nobody', which is not defined"):
        parse_tenants(EXAMPLE + '[shared_prefixes.x]\ntext = "t"\ntenants = ["acme", "nobody"]\n', "t.toml")


def test_the_caller_stamp_round_trips_and_refuses_garbage() -> None:
    caller = Caller("acme", "free", 2, "flex", 1000.0, 64, 30.0, (SharedPrefix("support", "ab" * 32, 9),))
    assert Caller.from_json(caller.to_json()) == caller
    for bad in (None, [], {"tenant": "acme"}, {**caller.to_json(), "tenant": "../../etc"}):
        with pytest.raises(ValueError):
            Caller.from_json(bad)


def test_a_reload_with_a_broken_file_keeps_the_tenants_in_force(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(EXAMPLE)
    source = TenantsSource(path)
    before = source.current
    path.write_text(EXAMPLE.replace('tier = "free"', 'tier = "platinum"'))
    ok, message = source.reload()
    assert not ok and "line 8: tenants.globex.tier" in message and source.current is before
    path.write_text(EXAMPLE + '[tenants.initech]\nkeys = ["key-c"]\n')
    ok, message = source.reload()
    assert ok and source.current.authenticate(b"key-c") is not None and "3 tenants" in message
    assert source.reloads == {"ok": 1, "failed": 1}
    with pytest.raises(TenantsError, match="cannot be read"):
        TenantsSource(tmp_path / "missing.toml")


def test_a_yaml_tenants_file_reads_as_its_toml_twin(tmp_path: Path) -> None:
    yaml_text = """\
tiers:
  - name: priority
    service_tier: priority
    ttft_ms: 1500
  - name: free
    service_tier: flex
tenants:
  acme:
    keys: [key-tenant-a]
    tier: priority
    requests_per_minute: 600
  globex:
    keys: ["key-tenant-b"]
    tier: free
    requests_per_minute: 8
"""
    tiers = '[[tiers]]\nname = "priority"\nservice_tier = "priority"\nttft_ms = 1500\n'
    toml_text = tiers + '[[tiers]]\nname = "free"\nservice_tier = "flex"\n\n' + EXAMPLE
    for suffix in (".yaml", ".yml"):
        (tmp_path / f"t{suffix}").write_text(yaml_text)
    (tmp_path / "t.toml").write_text(toml_text)
    from_toml = load_tenants(tmp_path / "t.toml")
    for suffix in (".yaml", ".yml"):
        from_yaml = load_tenants(tmp_path / f"t{suffix}")
        assert (from_yaml.tiers, from_yaml.tenants) == (from_toml.tiers, from_toml.tenants)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml_text.replace("tier: free\n    requests", "tier: gold\n    requests"))
    with pytest.raises(TenantsError, match=r"line 14: tenants\.globex\.tier"):
        load_tenants(bad)
    (tmp_path / "evil.yaml").write_text("tenants: !!python/object/apply:os.system [echo hi]\n")
    with pytest.raises(TenantsError, match="fix the YAML"):
        load_tenants(tmp_path / "evil.yaml")


def test_max_sessions_caps_a_tenants_session_index_and_is_checked_at_load() -> None:
    capped = parse_tenants(EXAMPLE.replace("requests_per_minute = 8", "max_sessions = 500"), "t.toml")
    acme, globex = capped.tenants
    assert (acme.max_sessions, globex.max_sessions) == (DEFAULT_MAX_SESSIONS, 500)
    caller = capped.caller(globex, None)
    assert caller.max_sessions == 500 and Caller.from_json(caller.to_json()) == caller
    assert Caller.from_json({**caller.to_json(), "max_sessions": None}).max_sessions == DEFAULT_MAX_SESSIONS
    for bad, why in (("0", "must be positive (got 0)"), ("2.5", "must be an integer (got 2.5)")):
        with pytest.raises(TenantsError) as raised:
            parse_tenants(EXAMPLE.replace("requests_per_minute = 8", f"max_sessions = {bad}"), "t.toml")
        assert f"line 9: tenants.globex.max_sessions {why}" in str(raised.value)
        assert "\n" not in str(raised.value)
