"""Who may talk to a specdec port (issue 24, item 13): TLS and mutual TLS from PEM files, the
shared bearer token of the internal services, Redis passwords kept out of what is printed, and
internal ports on 127.0.0.1 unless told otherwise -- against a real grpc.aio server running the
target service over a tiny model, and a real stack of processes."""

from __future__ import annotations

import asyncio
import datetime
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.runtime import security
from specdec.runtime.security import Security, SecurityConfigError, redacted

# -- certificates made here: a CA, a server certificate for 127.0.0.1, a client certificate ------


def _certificates(directory):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(common):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def issue(subject, key, issuer, issuer_key, ca=False, san=None):
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    import ipaddress

    def write(stem, cert, key):
        (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{stem}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = issue("specdec test CA", ca_key, "specdec test CA", ca_key, ca=True)
    write("ca", ca, ca_key)
    for stem in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        write(stem, issue(f"specdec {stem}", key, "specdec test CA", ca_key, san=san), key)
    return directory


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return _certificates(tmp_path_factory.mktemp("certs"))


def test_settings_are_checked_and_name_the_setting(tmp_path, certs):
    with pytest.raises(SecurityConfigError, match="go together"):
        Security(cert=str(certs / "server.pem"))
    with pytest.raises(SecurityConfigError, match="SPECDEC_TLS_CA: no such file"):
        Security(ca=str(tmp_path / "missing.pem"))
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    assert security.from_env({security.TOKEN_FILE_ENV: str(token_file)}).token == "s3cret"
    token_file.write_text("")
    with pytest.raises(SecurityConfigError, match="empty"):
        security.from_env({security.TOKEN_FILE_ENV: str(token_file)})


def test_a_redis_password_never_reaches_what_is_printed():
    assert redacted("redis://:hunter2@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redacted("rediss://app:hunter2@10.0.0.5/1") == "rediss://app:***@10.0.0.5/1"
    assert redacted("redis://redis:6379/0") == "redis://redis:6379/0"


def _serve_target(model, sec: Security):
    """A real target service over ``model`` on a grpc.aio server with ``sec``; (server, port)."""
    from replica.target import SERVICE, TargetServicer
    from specdec.engine.target import TargetEngine
    from specdec.runtime import grpc_server as srv
    from specdec.v1 import target_pb2_grpc

    server = srv.create_server(token=sec.token or None)
    target_pb2_grpc.add_TargetServicer_to_server(TargetServicer(TargetEngine(model), "tiny-target"), server)
    srv.add_health_and_reflection(server, [SERVICE])
    port = security.bind(server, "127.0.0.1:0", sec)
    return server, port


def test_mutual_tls_and_the_token_admit_only_who_has_both(target_model, certs):
    from specdec.runtime.grpc_server import client_channel
    from specdec.v1 import engine_pb2, target_pb2_grpc

    server_side = Security(str(certs / "server.pem"), str(certs / "server.key"), str(certs / "ca.pem"), "t0ken")
    full = Security(str(certs / "client.pem"), str(certs / "client.key"), str(certs / "ca.pem"), "t0ken")
    no_token = Security(full.cert, full.key, full.ca, "")
    wrong_token = Security(full.cert, full.key, full.ca, "guess")
    no_client_cert = Security(ca=full.ca, token="t0ken")

    async def info(sec: Security | None) -> str:
        channel = client_channel(address, sec) if sec is not None else grpc.aio.insecure_channel(address)
        async with channel:
            try:
                await target_pb2_grpc.TargetStub(channel).Info(engine_pb2.InfoRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            return "OK"

    async def health(sec: Security) -> str:
        async with client_channel(address, sec) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def main():
        nonlocal address
        server, port = _serve_target(target_model, server_side)
        address = f"127.0.0.1:{port}"
        await server.start()
        try:
            return {
                "full": await info(full),
                "no token": await info(no_token),
                "wrong token": await info(wrong_token),
                "no client certificate": await info(no_client_cert),
                "plaintext": await info(None),
                "health without a token": await health(no_token),
            }
        finally:
            await server.stop(None)

    address = ""
    outcome = asyncio.run(main())
    assert outcome == {
        "full": "OK",
        "no token": "UNAUTHENTICATED",
        "wrong token": "UNAUTHENTICATED",
        "no client certificate": "UNAVAILABLE",  # the TLS handshake fails: no call is made
        "plaintext": "UNAVAILABLE",
        "health without a token": "SERVING",  # kubelet's probes carry no token
    }


def test_the_public_ports_trust_their_own_client_ca_and_never_the_internal_one(certs, tmp_path_factory):
    """Issue 62, item 12: SPECDEC_TLS_CA made the coordinator's public ports require client
    certificates from the internal CA -- the one the replicas and coordinator prove themselves
    with -- so trusting an outside client meant issuing it an internal identity. Now the public
    ports (gRPC and HTTPS) ask for a client certificate only with SPECDEC_PUBLIC_TLS_CLIENT_CA,
    and then admit that CA's clients alone; internal ports keep the internal CA's mutual TLS."""
    import ssl

    import httpx
    from grpc_health.v1 import health
    from stack_util import http_api_alone

    from specdec.runtime.grpc_server import client_channel

    public = _certificates(tmp_path_factory.mktemp("public-certs"))  # another CA, and a client it signed
    internal_ca = str(certs / "ca.pem")
    served = Security(str(certs / "server.pem"), str(certs / "server.key"), internal_ca)
    with_public_ca = Security(served.cert, served.key, internal_ca, public_client_ca=str(public / "ca.pem"))
    clients = {
        "no certificate": Security(ca=internal_ca),
        "internal certificate": Security(str(certs / "client.pem"), str(certs / "client.key"), internal_ca),
        "public certificate": Security(str(public / "client.pem"), str(public / "client.key"), internal_ca),
    }

    async def answers(sec: Security, public_port: bool) -> dict[str, str]:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        address = f"127.0.0.1:{security.bind(server, '127.0.0.1:0', sec, public=public_port)}"
        await server.start()
        out = {}
        try:
            for who, client in clients.items():
                async with client_channel(address, client) as channel:
                    try:
                        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                        out[who] = "OK"
                    except grpc.aio.AioRpcError as exc:
                        out[who] = exc.code().name
        finally:
            await server.stop(None)
        return out

    assert asyncio.run(answers(served, public_port=True)) == {
        "no certificate": "OK",  # API keys say who a public client is
        "internal certificate": "OK",
        "public certificate": "OK",
    }
    assert asyncio.run(answers(with_public_ca, public_port=True)) == {
        "no certificate": "UNAVAILABLE",
        "internal certificate": "UNAVAILABLE",  # an internal identity is no public client's
        "public certificate": "OK",
    }
    assert asyncio.run(answers(with_public_ca, public_port=False)) == {
        "no certificate": "UNAVAILABLE",
        "internal certificate": "OK",
        "public certificate": "UNAVAILABLE",
    }

    def https_status(port: int, client: Security) -> int | str:
        tls = ssl.create_default_context(cafile=internal_ca)
        if client.cert:
            tls.load_cert_chain(client.cert, client.key)
        try:
            return httpx.get(f"https://127.0.0.1:{port}/health", verify=tls, timeout=10).status_code
        except httpx.HTTPError:
            return "refused"

    for sec, admitted in ((served, set(clients)), (with_public_ca, {"public certificate"})):
        with http_api_alone(tls=sec) as port:
            for who, client in clients.items():
                status = https_status(port, client)  # 503: answered (its request path is not started)
                assert (status == 503) == (who in admitted), (sec.public_client_ca, who, status)
    with pytest.raises(SecurityConfigError, match="SPECDEC_PUBLIC_TLS_CLIENT_CA needs a server certificate"):
        Security(public_client_ca=str(public / "ca.pem"))


@pytest.mark.integration
@pytest.mark.slow
def test_a_stack_over_mutual_tls_with_a_token_generates_and_a_plaintext_client_is_refused(certs, tmp_path):
    """The real stack -- target, draft and the coordinator with its Ray actor, each its own
    process -- with mutual TLS on the internal ports, TLS on the public ones and the token on
    the internal ones, all from the environment a Secret would set; a request through it
    generates every token it asks for."""
    from stack_util import request, save_tiny_pair

    from specdec.apps.launcher import local_stack
    from specdec.runtime.grpc_server import sync_channel
    from specdec.v1 import coordinator_pb2_grpc, engine_pb2, target_pb2_grpc

    target, draft = save_tiny_pair(tmp_path, 32, seed=3, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    (tmp_path / "api-keys").write_text(f"{ALPHA} alpha 1\n{BRAVO} bravo\n")
    env = {
        security.CERT_ENV: str(certs / "server.pem"),
        security.KEY_ENV: str(certs / "server.key"),
        security.CA_ENV: str(certs / "ca.pem"),
        security.TOKEN_ENV: "stack-t0ken",
        "SPECDEC_API_KEY_FILE": str(tmp_path / "api-keys"),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with local_stack(target, draft, log_dir=tmp_path / "logs") as stack:
            req = request([1, 2, 3], k=2, temperature=0.0, max_new_tokens=12, ignore_eos=True)
            with sync_channel(stack.coordinator_address) as channel:
                coordinator = coordinator_pb2_grpc.CoordinatorStub(channel)
                reply = coordinator.Generate(req, timeout=120, metadata=[("authorization", f"Bearer {ALPHA}")])
                assert len(reply.token_ids) == 12
                for metadata in ([], [("authorization", "Bearer sk-not-a-key-0123456789")]):
                    with pytest.raises(grpc.RpcError) as info:
                        coordinator.Generate(req, timeout=10, metadata=metadata)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with grpc.insecure_channel(stack.coordinator_address) as channel, pytest.raises(grpc.RpcError) as info:
                coordinator_pb2_grpc.CoordinatorStub(channel).Generate(req, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            # Issue 62, item 12: the public port trusts the internal CA for no client. A TLS client
            # without a certificate is served (its API key says who it is); the replicas, whose
            # mutual TLS is the internal trust, still refuse it.
            certless = Security(ca=str(certs / "ca.pem"))
            with sync_channel(stack.coordinator_address, certless) as channel:
                keyed = [("authorization", f"Bearer {ALPHA}")]
                reply = coordinator_pb2_grpc.CoordinatorStub(channel).Generate(req, timeout=120, metadata=keyed)
                assert len(reply.token_ids) == 12
            target_address = next(c.address for c in stack.children if c.name == "target-0")
            with sync_channel(target_address, certless) as channel, pytest.raises(grpc.RpcError) as info:
                target_pb2_grpc.TargetStub(channel).Info(engine_pb2.InfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            check_the_https_api(stack.http_url, certs)
            del os.environ[security.TOKEN_ENV]  # TLS alone, without the token: the target refuses
            with sync_channel(target_address) as channel, pytest.raises(grpc.RpcError) as info:
                target_pb2_grpc.TargetStub(channel).Info(engine_pb2.InfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


ALPHA, BRAVO = "sk-alpha-0123456789abcdef", "sk-bravo-0123456789abcdef"


def check_the_https_api(http_url: str, certs) -> None:
    """The HTTP API of a coordinator with TLS and API keys: HTTPS only (with the client
    certificate its CA requires), the key required as OpenAI's bearer token, each key's limit
    of requests in flight (an n=2 request is two), and health open to probes."""
    import ssl

    import httpx
    import openai

    https = http_url.replace("http://", "https://")
    tls = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    tls.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))

    def client(key: str) -> openai.OpenAI:
        transport = httpx.Client(verify=tls, timeout=60)
        return openai.OpenAI(base_url=f"{https}/v1", api_key=key, max_retries=0, http_client=transport)

    (model,) = [m.id for m in client(BRAVO).models.list().data]
    done = client(ALPHA).completions.create(model=model, prompt=[1, 2, 3], max_tokens=5, temperature=0)
    assert done.usage.completion_tokens == 5
    with pytest.raises(openai.AuthenticationError):
        client("sk-not-a-key-0123456789").completions.create(model=model, prompt=[1, 2, 3], max_tokens=5)
    with pytest.raises(openai.AuthenticationError):
        client("sk-not-a-key-0123456789").models.list()
    with pytest.raises(openai.RateLimitError, match="'alpha' has 1 requests in flight, its limit is 1"):
        client(ALPHA).completions.create(model=model, prompt=[1, 2, 3], max_tokens=5, n=2)
    assert len(client(BRAVO).completions.create(model=model, prompt=[1, 2, 3], max_tokens=5, n=2).choices) == 2
    certless = ssl.create_default_context(cafile=str(certs / "ca.pem"))  # issue 62, item 12: as on gRPC
    with httpx.Client(verify=certless, timeout=60) as transport:
        listed = openai.OpenAI(base_url=f"{https}/v1", api_key=BRAVO, max_retries=0, http_client=transport)
        assert [m.id for m in listed.models.list().data] == [model]
    with pytest.raises(httpx.HTTPError):  # no plain HTTP beside a TLS port
        httpx.get(f"{http_url}/health", timeout=10)
    assert httpx.get(f"{https}/health", verify=tls, timeout=10).status_code == 200  # no key needed


def test_services_listen_on_loopback_unless_told_otherwise():
    code = (
        "import argparse\n"
        "from coordinator.main import add_arguments as c\n"
        "from replica.draft import add_arguments as d\n"
        "from replica.target import add_arguments as t\n"
        "for add in (c, d, t):\n"
        '    p = argparse.ArgumentParser(); add(p); print(p.get_default("host"))\n'
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["127.0.0.1"] * 3


def test_bad_tls_flags_stop_a_service_with_one_line_naming_the_setting(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "specdec", "draft", "--model", "ngram", "--tls-cert", str(tmp_path / "no.pem")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "SPECDEC_TLS_CERT and SPECDEC_TLS_KEY" in result.stderr  # a cert without its key


@pytest.mark.parametrize(
    "code, details, leaks",
    [
        (
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.3.7:50052: Connection refused",
            ["10.0.3.7", "50052"],
        ),
        # issue 62, item 12: the transport's other spellings of a peer, and its errno text
        (
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses; last error: UNAVAILABLE: ipv6:%5Bfd00::7%5D:50052: Socket closed",
            ["fd00", "50052"],
        ),
        (
            grpc.StatusCode.UNAVAILABLE,
            "DNS resolution failed for specdec-target-0:50052: C-ares status is not ARES_SUCCESS qtype=A "
            "name=specdec-target-0 is_balancer=0: Domain name not found",
            ["specdec-target-0", "50052"],
        ),
        (
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses; last error: UNKNOWN: unix:/run/specdec/target.sock: "
            "connect: No such file or directory (2)",
            ["/run/specdec", "No such file"],
        ),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded on ipv4:10.0.3.7:50052", ["10.0.3.7"]),
        (grpc.StatusCode.INTERNAL, "internal error in Verify (error id 0a1b2c; ipv4:10.0.3.7:50052)", ["10.0.3.7"]),
    ],
)
def test_replica_errors_reach_clients_without_internal_addresses(code, details, leaks):
    """A failed call to a replica becomes the client's status naming the replica's kind and the
    problem; its address (and any peer, path or errno gRPC's transport error names) stays in the log."""
    from coordinator.peers import _peer_error

    class Failed(grpc.aio.AioRpcError):
        def __init__(self):
            pass

        def code(self):
            return code

        def details(self):
            return details

    error = _peer_error("target", "10.0.3.7:50052", Failed())
    assert error.code == code.name and str(error).startswith(f"target replica: {code.name}")
    for leak in leaks:
        assert leak not in str(error), str(error)
    if code == grpc.StatusCode.INTERNAL:  # the replica's own message (its error id) is kept
        assert "error id 0a1b2c" in str(error)


def test_metrics_listen_on_the_processs_own_interface(monkeypatch):
    from specdec.telemetry import metrics

    seen = {}
    monkeypatch.setattr(metrics, "start_http_server", lambda port, addr, registry: seen.update(port=port, addr=addr))
    metrics.serve_metrics(9999, "127.0.0.1")
    assert seen == {"port": 9999, "addr": "127.0.0.1"}
    seen.clear()
    metrics.serve_metrics(0, "0.0.0.0")
    assert seen == {}  # off


def test_specdec_secrets_makes_a_valid_secret_whose_certificate_serves_by_name_and_specdec_health_probes_it(
    target_model, tmp_path
):
    """`specdec secrets` (what deploy/ mounts): a valid v1 Secret of a random token, Redis
    password and API keys, a CA and one certificate for the replicas' shared name. A replica
    serving that certificate on an IP answers a client that checks the name
    (SPECDEC_TLS_SERVER_NAME) and refuses one that checks the address; `specdec health` -- the
    pods' exec probe -- speaks that TLS and says SERVING."""
    import base64

    import kubernetes_validate
    import yaml

    from coordinator.api_keys import parse_key_lines
    from specdec.apps.ops import secret_data, secret_manifest

    data, keys = secret_data("specdec-internal", api_keys=2)
    again, _ = secret_data("specdec-internal")
    assert data["auth-token"] != again["auth-token"] and data["redis-password"] != again["redis-password"]
    assert [k.secret for k in parse_key_lines(data["api-keys"].decode(), 8, "api-keys")] == keys
    manifest = yaml.safe_load(secret_manifest("specdec-secrets", "ns", data))
    kubernetes_validate.validate(manifest, "1.34", strict=True)
    assert base64.b64decode(manifest["data"]["tls.key"]) == data["tls.key"]
    for name in ("ca.crt", "tls.crt", "tls.key"):
        (tmp_path / name).write_bytes(data[name])
    cert, key, ca = (str(tmp_path / n) for n in ("tls.crt", "tls.key", "ca.crt"))

    def probe(env_extra) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_TLS")}
        env.update({security.CERT_ENV: cert, security.KEY_ENV: key, security.CA_ENV: ca, **env_extra})
        command = [sys.executable, "-m", "specdec", "health", address, "--timeout", "10"]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)

    async def main():
        nonlocal address
        server, port = _serve_target(target_model, Security(cert, key, ca))
        address = f"127.0.0.1:{port}"
        await server.start()
        try:
            by_name = await asyncio.to_thread(probe, {security.SERVER_NAME_ENV: "specdec-internal"})
            by_address = await asyncio.to_thread(probe, {})
            return by_name, by_address
        finally:
            await server.stop(None)

    address = ""
    by_name, by_address = asyncio.run(main())
    assert by_name.returncode == 0, by_name.stderr
    assert by_address.returncode == 1 and "UNAVAILABLE" in by_address.stderr  # the certificate is not for 127.0.0.1
