"""API keys of the public APIs (coordinator/api_keys.py, issue 42 item 3): parsing, checking,
per-key limits and tenant scopes. Through a real stack (gRPC, and HTTPS with the openai client):
tests/test_security.py."""

from __future__ import annotations

import json
import socket

import pytest
from stack_util import http_api_alone

from coordinator.api_keys import ApiKey, ApiKeys, from_env, has_own_scope, parse_key_lines, scoped_salt
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
    # a scope of its own -- a key or a salt -- is what lets a request be told its cache hits
    assert has_own_scope(alpha, "") and has_own_scope(None, "x") and not has_own_scope(None, "")


# -- the HTTP API's door: the key before the body ---------------------------------------------
def _exchange(port: int, authorization: str | None, body: bytes, declared: int | None = None) -> tuple[int, dict]:
    """POST /v1/completions over a raw socket: the headers (``declared``: the Content-Length
    they announce, default the body's), then ``body``, then the answer, read until the server
    closes. A server that waits for bytes never sent answers nothing: socket.timeout."""
    head = [
        "POST /v1/completions HTTP/1.1",
        "Host: x",
        "Content-Type: application/json",
        f"Content-Length: {len(body) if declared is None else declared}",
        "Connection: close",
    ]
    if authorization is not None:
        head.append(f"Authorization: {authorization}")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + body)
        answer = b""
        while part := sock.recv(1 << 16):
            answer += part
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_a_caller_without_a_valid_key_is_refused_before_its_body_is_read_or_parsed():
    """Issue 62, item 8: the body was read, parsed and fanned out into requests before the key
    was looked at (a 3.8 MB body became 256 requests and held the event loop 1.3 s before its
    401). Now the key in the headers is checked first: a 3.8 MB body announced and never sent
    gets its 401 at once, and a body that is not even JSON gets 401, not 400 -- while the right
    key's same body reaches the parser."""
    with http_api_alone(ApiKeys([ApiKey("alpha", A, 2)])) as port:
        status, answer = _exchange(port, "Bearer sk-not-a-key-0123456789", b"", declared=3_800_000)
        assert status == 401 and answer["error"]["type"] == "authentication_error", answer
        for authorization in (None, "Bearer sk-not-a-key-0123456789", A):
            status, answer = _exchange(port, authorization, b"{not json")
            assert status == 401 and "API key" in answer["error"]["message"], (authorization, answer)
        status, answer = _exchange(port, f"Bearer {A}", b"{not json")
        assert status == 400 and "not valid JSON" in answer["error"]["message"], answer
