"""API keys of the public APIs (coordinator/api_keys.py, issue 42 item 3): parsing, checking,
per-key limits and tenant scopes. Through a real stack (gRPC, and HTTPS with the openai client):
tests/test_security.py."""

from __future__ import annotations

import pytest

from coordinator.api_keys import ApiKey, ApiKeys, from_env, parse_key_lines, scoped_salt
from specdec.errors import ResourceExhaustedError, UnauthenticatedError

A, B = "sk-alpha-0123456789abcdef", "sk-bravo-0123456789abcdef"


def test_the_key_file_names_keys_and_their_limits_and_refuses_what_it_cannot_read():
    keys = parse_key_lines(f"# tenants\n{A} alpha 2\n\n{B}   # bravo, default limit\n", 8, "f")
    assert [(k.name, k.max_concurrent) for k in keys] == [("alpha", 2), ("key4", 8)]
    for bad, what in (
        (f"{A} a 1 extra", "fields"),
        (f"{A} a lots", "integer"),
        (f"{A} a 0", ">= 1"),
        ("short", "at least 16"),
    ):
        with pytest.raises(ValueError, match=what):
            parse_key_lines(bad, 8, "f")
    with pytest.raises(ValueError, match="twice"):
        ApiKeys(parse_key_lines(f"{A}\n{A}\n", 8, "f"))


def test_from_the_environment(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{A} alpha 3\n")
    keys = from_env({"SPECDEC_API_KEY_FILE": str(path), "SPECDEC_API_KEY": B}, default_max_concurrent=5)
    assert [(k.name, k.max_concurrent) for k in keys.keys] == [("alpha", 3), ("default", 5)]
    assert not from_env({}).enabled
    with pytest.raises(ValueError, match="SPECDEC_API_KEY_FILE"):
        from_env({"SPECDEC_API_KEY_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        from_env({"SPECDEC_API_KEY_FILE": str(tmp_path / "empty")})


def test_a_call_needs_a_configured_key_and_without_keys_anyone_may_call():
    keys = ApiKeys([ApiKey("alpha", A, 2), ApiKey("bravo", B, 2)])
    assert keys.authenticate(f"Bearer {A}").name == "alpha"
    assert keys.authenticate(f"bearer {B}").name == "bravo"
    for bad in (None, "", A, f"Bearer {A}x", "Basic xyz", "Bearer "):
        with pytest.raises(UnauthenticatedError):
            keys.authenticate(bad)
    assert ApiKeys([]).authenticate(None) is None


def test_each_key_has_its_own_limit_of_requests_in_flight():
    alpha, bravo = ApiKey("alpha", A, 2), ApiKey("bravo", B, 1)
    keys = ApiKeys([alpha, bravo])
    with keys.slot(alpha), keys.slot(alpha):
        with (
            pytest.raises(ResourceExhaustedError, match="'alpha' has 2 requests in flight, its limit is 2"),
            keys.slot(alpha),
        ):
            pass
        with keys.slot(bravo):  # another key is not held back by alpha's load
            pass
    assert keys.in_flight == {A: 0, B: 0}  # released, also after the refusal
    with keys.slot(None):  # no keys configured
        pass


def test_a_tenants_scope_hides_the_key_and_keeps_tenants_apart():
    alpha, bravo = ApiKey("alpha", A, 1), ApiKey("bravo", B, 1)
    assert A not in alpha.tenant and alpha.tenant != bravo.tenant
    assert scoped_salt(alpha, "") != scoped_salt(bravo, "")  # the same prompt never shares across keys
    assert scoped_salt(alpha, "x") != scoped_salt(alpha, "")  # a request's salt narrows it further
    assert scoped_salt(alpha, "x") == scoped_salt(alpha, "x")  # and is stable (a resume matches)
    assert len(scoped_salt(alpha, "s" * 256)) == 32
    assert scoped_salt(None, "x") == "x"  # without keys: the request's own salt
