"""Who may talk to a specdec port: optional TLS or mutual TLS on every gRPC server and client,
an optional shared bearer token the draft and target services require, and Redis credentials
that never reach a log.

The settings are per process and come from the environment (what a Kubernetes Secret mounts), or
from the service's flags, which set the same variables -- so the coordinator's Ray actors, started
from its environment, dial the services exactly as it would:

- ``SPECDEC_TLS_CERT`` / ``SPECDEC_TLS_KEY``: PEM files of this process's certificate chain and
  key. A server with them serves TLS; a client presents them under mutual TLS.
- ``SPECDEC_TLS_CA``: PEM file of the internal CA that signs the peers. A client with it speaks
  TLS and verifies the server; an internal server (draft, target) with it also requires and
  verifies client certificates (mTLS). The coordinator's public ports never trust it for clients.
- ``SPECDEC_PUBLIC_TLS_CLIENT_CA`` (coordinator): PEM file of the CA whose client certificates the
  public ports (gRPC and HTTPS) require -- mutual TLS for clients, a trust apart from the
  internal one. Unset: the public ports serve TLS without asking clients for a certificate
  (clients are identified by their API keys).
- ``SPECDEC_TLS_SERVER_NAME``: the name a client checks the server's certificate against, in
  place of the address it dials -- replicas are dialed by pod IP, and share one certificate for
  that name (deploy/ and ``specdec secrets``).
- ``SPECDEC_AUTH_TOKEN`` (or ``SPECDEC_AUTH_TOKEN_FILE``): the shared token. Draft and target
  services refuse calls without ``authorization: Bearer <token>`` (UNAUTHENTICATED), except the
  health check, which kubelet's probes call; the coordinator sends it on every call. It also
  keys the HMAC that authenticates replica registry records (runtime.registry).
- ``REDIS_USERNAME`` / ``REDIS_PASSWORD``: who this process is to Redis (runtime.redis_client);
  deploy/ logs draft and target pods in as an ACL user that may write their registry records only.
"""

from __future__ import annotations

import hmac
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

CERT_ENV, KEY_ENV, CA_ENV = "SPECDEC_TLS_CERT", "SPECDEC_TLS_KEY", "SPECDEC_TLS_CA"
SERVER_NAME_ENV = "SPECDEC_TLS_SERVER_NAME"
PUBLIC_CLIENT_CA_ENV = "SPECDEC_PUBLIC_TLS_CLIENT_CA"
TOKEN_ENV, TOKEN_FILE_ENV = "SPECDEC_AUTH_TOKEN", "SPECDEC_AUTH_TOKEN_FILE"
REDIS_PASSWORD_ENV, REDIS_USERNAME_ENV = "REDIS_PASSWORD", "REDIS_USERNAME"
ENV_NAMES = (
    CERT_ENV,
    KEY_ENV,
    CA_ENV,
    SERVER_NAME_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    REDIS_PASSWORD_ENV,
    REDIS_USERNAME_ENV,
)
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # probes and tooling: no token


class SecurityConfigError(ValueError):
    """Inconsistent or unreadable TLS / token settings (said at startup, naming the setting)."""


@dataclass(frozen=True)
class Security:
    cert: str = ""
    key: str = ""
    ca: str = ""
    token: str = ""
    server_name: str = ""  # verify servers' certificates for this name, not the dialed address
    public_client_ca: str = ""  # the public ports require client certificates it signed ("" = none)

    def __post_init__(self):
        if bool(self.cert) != bool(self.key):
            raise SecurityConfigError(f"{CERT_ENV} and {KEY_ENV} (--tls-cert / --tls-key) go together")
        if self.public_client_ca and not self.cert:
            raise SecurityConfigError(f"{PUBLIC_CLIENT_CA_ENV} needs a server certificate ({CERT_ENV} / {KEY_ENV})")
        files = {CERT_ENV: self.cert, KEY_ENV: self.key, CA_ENV: self.ca, PUBLIC_CLIENT_CA_ENV: self.public_client_ca}
        for name, path in files.items():
            if path and not Path(path).is_file():
                raise SecurityConfigError(f"{name}: no such file {path!r}")

    @property
    def server_tls(self) -> bool:
        return bool(self.cert)

    @property
    def client_tls(self) -> bool:
        return bool(self.ca)

    def client_ca(self, public: bool) -> str:
        """The CA whose client certificates a server requires ("" = none): on an internal port the
        internal CA, on a public one (the coordinator's APIs) only the public client CA -- a
        certificate the deployment issued its own services never admits an outside client."""
        return self.public_client_ca if public else self.ca

    def server_credentials(self, public: bool = False) -> grpc.ServerCredentials | None:
        if not self.server_tls:
            return None
        client_ca = self.client_ca(public)
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=_read(client_ca) if client_ca else None,
            require_client_auth=bool(client_ca),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        """Channel options the settings add (the name a server's certificate is checked for)."""
        if self.client_tls and self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.client_tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca),
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None,
        )


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def from_env(env: Mapping[str, str] | None = None) -> Security:
    env = os.environ if env is None else env
    token = env.get(TOKEN_ENV, "")
    if not token and env.get(TOKEN_FILE_ENV):
        try:
            token = Path(env[TOKEN_FILE_ENV]).read_text().strip()
        except OSError as exc:
            raise SecurityConfigError(f"{TOKEN_FILE_ENV}: cannot read {env[TOKEN_FILE_ENV]!r}: {exc}") from None
        if not token:
            raise SecurityConfigError(f"{TOKEN_FILE_ENV}: {env[TOKEN_FILE_ENV]!r} is empty")
    return Security(
        env.get(CERT_ENV, ""),
        env.get(KEY_ENV, ""),
        env.get(CA_ENV, ""),
        token,
        env.get(SERVER_NAME_ENV, ""),
        env.get(PUBLIC_CLIENT_CA_ENV, ""),
    )


def current() -> Security:
    """This process's settings (read from the environment each time: cheap, and never stale)."""
    return from_env()


def add_arguments(p) -> None:
    """The flags every server takes; each sets its environment variable (see the module doc)."""
    p.add_argument("--tls-cert", default=None, help=f"PEM certificate chain: serve TLS (env {CERT_ENV})")
    p.add_argument("--tls-key", default=None, help=f"PEM private key of --tls-cert (env {KEY_ENV})")
    p.add_argument(
        "--tls-ca",
        default=None,
        help=f"PEM CA of the internal peers: clients verify servers with it, draft and target servers then require "
        f"client certificates it signed (mutual TLS) (env {CA_ENV})",
    )
    p.add_argument(
        "--auth-token-file",
        default=None,
        help=f"file holding the shared token the draft/target services require (env {TOKEN_ENV} or {TOKEN_FILE_ENV})",
    )


def add_public_arguments(p) -> None:
    """The flags of a process with public ports (the coordinator)."""
    p.add_argument(
        "--public-tls-client-ca",
        default=None,
        help=f"PEM CA whose client certificates the public gRPC and HTTPS ports require (mutual TLS for clients; "
        f"apart from --tls-ca, which they never trust for clients) (env {PUBLIC_CLIENT_CA_ENV}; default: no "
        "client certificate asked for)",
    )


def apply_arguments(args) -> Security:
    """Put the flags given into the environment (children and Ray workers inherit it), and check
    the result: bad settings stop the process with one line naming the setting, no traceback."""
    flags = {"tls_cert": CERT_ENV, "tls_key": KEY_ENV, "tls_ca": CA_ENV, "public_tls_client_ca": PUBLIC_CLIENT_CA_ENV}
    for flag, name in flags.items():
        value = getattr(args, flag, None)
        if value:
            os.environ[name] = str(Path(value).resolve())
    if getattr(args, "auth_token_file", None):
        os.environ[TOKEN_FILE_ENV] = str(Path(args.auth_token_file).resolve())
    try:
        return current()
    except SecurityConfigError as exc:
        raise SystemExit(f"specdec: {exc}") from None


def forwarded_env() -> dict[str, str]:
    """The variables a process started elsewhere (a Ray actor on another node) needs to dial alike."""
    return {name: os.environ[name] for name in ENV_NAMES if os.environ.get(name)}


# -- server side ----------------------------------------------------------------------------------
async def _refuse(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (authorization metadata)")


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuse every call but the open ones (health, reflection) without the shared token."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHODS):
            return handler
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(given).encode(), self._expected):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind (and deserializers) as ``handler`` that aborts UNAUTHENTICATED."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        _refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


def server_interceptors(security: Security | None = None) -> list:
    security = security or current()
    return [TokenCheck(security.token)] if security.token else []


def bind(server: grpc.aio.Server, address: str, security: Security | None = None, public: bool = False) -> int:
    """Listen on ``address`` with TLS when configured; the bound port (0: could not bind).
    ``public``: a port outside clients call (see :meth:`Security.client_ca`)."""
    credentials = (security or current()).server_credentials(public)
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


# -- client side ----------------------------------------------------------------------------------
class _TokenMetadata:
    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        metadata = grpc.aio.Metadata(*(tuple(details.metadata or ())), self._header)
        return details._replace(metadata=metadata)


class _UnaryUnary(_TokenMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _UnaryStream(_TokenMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _StreamUnary(_TokenMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_token(client_call_details), request_iterator)


class _StreamStream(_TokenMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_token(client_call_details), request_iterator)


def client_interceptors(security: Security | None = None) -> list:
    security = security or current()
    if not security.token:
        return []
    return [kind(security.token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


# -- Redis ----------------------------------------------------------------------------------------
def redacted(url: str) -> str:
    """``url`` with any password replaced by ``***``: what may be printed or logged."""
    parts = urllib.parse.urlsplit(url)
    if not parts.password:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))
