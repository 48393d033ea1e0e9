"""Operations helpers: ``specdec health`` (a health probe that speaks the process's TLS, for
Kubernetes exec probes -- kubelet's own gRPC probe is plaintext only) and ``specdec secrets`` (the
Secret deploy/ mounts: the internal token, the Redis passwords, API keys, a CA and the replicas'
shared certificate, all generated here; nothing of it is ever committed)."""

from __future__ import annotations

import argparse
import base64
import datetime
import secrets
import sys

DEFAULT_SERVER_NAME = "specdec-internal"  # the name every replica's certificate is issued for
CERT_DAYS = 365


# -- specdec health ---------------------------------------------------------------------------
def add_health_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help="HOST:PORT of a specdec gRPC port")
    p.add_argument("--service", default="", help="the service to ask about (default: the server as a whole)")
    p.add_argument("--timeout", type=float, default=3.0)


def health_main(args) -> int:
    """0 when the port answers SERVING, 1 otherwise (a line on stderr says what it answered)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.runtime.grpc_server import sync_channel

    try:
        with sync_channel(args.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except grpc.RpcError as exc:
        print(f"specdec health: {args.address}: {exc.code().name}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"specdec health: {args.address}: {status}", file=sys.stderr)
        return 1
    return 0


# -- specdec secrets ----------------------------------------------------------------------------
def _pem_pair(common_name: str, issuer_key=None, issuer_cert=None, dns_names=()):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    ca = issuer_key is None
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name if ca else issuer_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False
        ).add_extension(
            # every replica serves and dials: the one certificate is both
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key, cert, cert.public_bytes(serialization.Encoding.PEM), key_pem


def secret_data(server_name: str = DEFAULT_SERVER_NAME, api_keys: int = 1) -> tuple[dict[str, bytes], list[str]]:
    """Every file of the Secret (name -> bytes) and the API keys in it."""
    ca_key, ca_cert, ca_pem, _ = _pem_pair("specdec internal CA")
    _, _, cert_pem, key_pem = _pem_pair(server_name, ca_key, ca_cert, dns_names=[server_name])
    keys = [f"sk-specdec-{secrets.token_urlsafe(24)}" for _ in range(api_keys)]
    lines = "".join(f"{key} client{i}\n" for i, key in enumerate(keys, 1))
    data = {
        "auth-token": secrets.token_urlsafe(32).encode(),
        "redis-password": secrets.token_urlsafe(32).encode(),  # Redis's default user: the coordinator
        # the ACL user draft and target pods log in as: it may write their registry records only
        "redis-replica-password": secrets.token_urlsafe(32).encode(),
        "api-keys": b"# KEY [NAME [MAX_CONCURRENT]] (coordinator/api_keys.py)\n" + lines.encode(),
        "ca.crt": ca_pem,
        "tls.crt": cert_pem,
        "tls.key": key_pem,
    }
    return data, keys


def secret_manifest(name: str, namespace: str | None, data: dict[str, bytes]) -> str:
    """A v1 Secret as YAML (base64 data), ready for ``kubectl apply -f -``."""
    import yaml

    metadata: dict = {"name": name, "labels": {"app.kubernetes.io/part-of": "specdec"}}
    if namespace:
        metadata["namespace"] = namespace
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        "data": {k: base64.b64encode(v).decode() for k, v in sorted(data.items())},
    }
    return yaml.safe_dump(body, sort_keys=False)


def add_secrets_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="specdec-secrets", help="the Secret's name (deploy/ mounts specdec-secrets)")
    p.add_argument("--namespace", default=None)
    p.add_argument(
        "--server-name", default=DEFAULT_SERVER_NAME, help="the name the replicas' certificate is issued for"
    )
    p.add_argument("--api-keys", type=int, default=1, help="API keys to generate (listed on stderr)")


def secrets_main(args) -> int:
    if args.api_keys < 1:
        raise SystemExit("specdec secrets: --api-keys must be >= 1")
    data, keys = secret_data(args.server_name, args.api_keys)
    print(secret_manifest(args.name, args.namespace, data), end="")
    print(f"specdec secrets: {len(keys)} API key(s) for the clients (also in the Secret's api-keys):", file=sys.stderr)
    for key in keys:
        print(f"  {key}", file=sys.stderr)
    return 0
