"""TLS, the job secret and credentials for the lighthouse and its clients.

The lighthouse holds the job secret; a client presents it or a credential derived from it (a replica group's, a
reader's: ``lighthouse.credentials``), read from a file (never from the command line, where ``ps`` shows it), as
``authorization: Bearer <value>`` (gRPC metadata and HTTP header alike), compared in constant time. The
interceptor refuses an unknown value before a request is parsed; ``Authority`` tells the handlers whether the caller
may act as the replica a request names. TLS covers the gRPC port and the HTTP side port; with a client CA the
server requires a client certificate signed by it (mTLS).
"""

from __future__ import annotations

import ipaddress
import os
import pathlib
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from lighthouse import credentials
from lighthouse.credentials import Principal
from lighthouse.errors import SecurityConfigError as SecurityConfigError  # raised here: part of this API

AUTH_HEADER = "authorization"
BEARER = "Bearer "
LEADER_METADATA = "fthsdp-leader"
"""Trailing metadata of a follower's refusal: the leader's address (empty when no leader is known)."""
TOKEN_MAX_BYTES = 4096

# The environment variables a client's options come from (read by ``lighthouse.config.security_from_env``).
ENV_TOKEN_FILE = "FTHSDP_TOKEN_FILE"
ENV_TLS_CA = "FTHSDP_TLS_CA"
ENV_TLS_CERT = "FTHSDP_TLS_CERT"
ENV_TLS_KEY = "FTHSDP_TLS_KEY"


def _lines(path: str | os.PathLike[str]) -> list[str]:
    """The non-empty lines of a token or credential file (at most two), each ASCII without whitespace."""
    try:
        raw = pathlib.Path(path).read_bytes()
    except OSError as e:
        raise SecurityConfigError(f"cannot read token file {str(path)!r}: {e.strerror}") from None
    if len(raw) > TOKEN_MAX_BYTES:
        raise SecurityConfigError(f"token file {str(path)!r} is over {TOKEN_MAX_BYTES} bytes")
    try:
        lines = [x.strip() for x in raw.decode("ascii").splitlines() if x.strip()]
    except UnicodeDecodeError:
        raise SecurityConfigError(f"token file {str(path)!r} is not ASCII (it goes into a header)") from None
    if not lines or len(lines) > 2 or any(c.isspace() or not c.isprintable() for x in lines for c in x):
        raise SecurityConfigError(f"token file {str(path)!r} is empty, holds whitespace/control characters or "
                                  "more than two lines (a token, or a credential and its catch-up key)")
    return lines


def read_token(path: str | os.PathLike[str]) -> str:
    """What a caller presents from ``path``: a job secret, or a credential (``lighthouse.credentials``) on the
    file's first line; refuses an empty, oversized or malformed file."""
    return _lines(path)[0]


def read_catchup_key(path: str | os.PathLike[str], job: str) -> str:
    """The key ``job``'s replicas prove membership to each other's catch-up servers with: derived from a job
    secret, or the second line of a replica's credential file (``credentials.credential_file``)."""
    lines = _lines(path)
    if len(lines) == 2:
        try:
            return credentials.parse_catchup_line(lines[1], job)
        except ValueError as e:
            raise SecurityConfigError(f"token file {str(path)!r}: {e}") from None
    if credentials.is_derived(lines[0]):
        raise SecurityConfigError(f"token file {str(path)!r} holds a credential without its catch-up key line: "
                                  "use the file `fthsdp secrets --replicas` wrote for this replica")
    return credentials.catchup_key(lines[0], job)


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as e:
        raise SecurityConfigError(f"cannot read {what} {path!r}: {e.strerror}") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP, brackets allowed) is a loopback address: ``localhost`` or an IP in
    127.0.0.0/8 or ::1. Used to confine the unauthenticated opt-ins (no token, plain TCP) to this machine."""
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def exposure(hosts: Sequence[str], security: ServerSecurity) -> list[str]:
    """Why serving on ``hosts`` (the gRPC and HTTP bind hosts) with ``security`` leaves the job open to whoever can
    reach them: empty on loopback, or with a job token over TLS. Off loopback, no token lets anyone register, take
    part in every all-reduce, read the status or make replicas leave; a token without TLS travels in clear, and
    its holder can do all of that and fetch every rank's weights (``fthsdp lighthouse`` refuses to start unless
    ``--insecure``)."""
    exposed = [h for h in hosts if not is_loopback(h)]
    if not exposed:
        return []
    where = ", ".join(repr(h or "*") for h in exposed)
    if not security.token:
        return [f"no job token on {where}: anyone who reaches it can join the job, send gradients into every "
                "all-reduce, read its status and make replicas leave"]
    if not security.tls:
        return [f"no TLS on {where}: the job token travels in clear, and whoever reads it off the network can do "
                "everything a replica can (fetch every rank's weights included)"]
    return []


def principal_of(secret: str | None, presented: str | None) -> Principal | None:
    """Who presents ``presented`` (a ``Bearer`` value or a bare one) to a server with job secret ``secret``:
    everyone is the job itself without a secret (loopback only: ``exposure``); None: refused."""
    if secret is None:
        return credentials.JOB_PRINCIPAL
    if not presented:
        return None
    return credentials.identify(secret, presented)


@dataclass(frozen=True)
class ServerSecurity:
    """The lighthouse's side: TLS certificate and key (both or neither), an optional client CA (mTLS) and an
    optional token. All empty: plaintext and no token (the embedded default)."""

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SecurityConfigError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise SecurityConfigError("--tls-client-ca needs --tls-cert/--tls-key (mTLS is on top of TLS)")
        if self.token and credentials.is_derived(self.token):
            raise SecurityConfigError("the lighthouse's --token-file must hold the job secret (`fthsdp secrets`: "
                                      "DIR/token), not a replica's or a reader's credential")

    @classmethod
    def from_files(cls, tls_cert: str | None = None, tls_key: str | None = None, tls_client_ca: str | None = None,
                   token_file: str | None = None) -> ServerSecurity:
        return cls(tls_cert or None, tls_key or None, tls_client_ca or None,
                   read_token(token_file) if token_file else None)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def grpc_credentials(self) -> grpc.ServerCredentials | None:
        """For ``add_secure_port``; None: plaintext."""
        if not self.tls:
            return None
        cert, key = _read(self.tls_cert, "TLS certificate"), _read(self.tls_key, "TLS key")
        assert cert is not None and key is not None
        ca = _read(self.tls_client_ca, "client CA")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    def ssl_context(self) -> ssl.SSLContext | None:
        """For the HTTP side port; None: plaintext."""
        if not self.tls:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(str(self.tls_cert), str(self.tls_key))
            if self.tls_client_ca:
                ctx.load_verify_locations(cafile=str(self.tls_client_ca))
                ctx.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as e:
            raise SecurityConfigError(f"cannot load TLS files: {e}") from None
        return ctx


@dataclass(frozen=True)
class ClientSecurity:
    """A client's side: the CA that signed the lighthouse's certificate (turns TLS on), an optional client
    certificate and key (mTLS), and the job token."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SecurityConfigError("client --tls-cert and --tls-key go together")
        if self.tls_cert and not self.tls_ca:
            raise SecurityConfigError("a client certificate needs --tls-ca (TLS to the lighthouse)")

    @classmethod
    def from_files(cls, tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                   token_file: str | None = None) -> ClientSecurity:
        return cls(tls_ca or None, tls_cert or None, tls_key or None,
                   read_token(token_file) if token_file else None)

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata to send with every call."""
        return ((AUTH_HEADER, BEARER + self.token),) if self.token else ()

    def http_headers(self) -> dict[str, str]:
        return {"Authorization": BEARER + self.token} if self.token else {}

    def channel(self, address: str, options: list[tuple[str, Any]] | None = None, *, aio: bool = True) -> Any:
        """A gRPC channel to ``address``: TLS when a CA is set (the token goes as per-call metadata, so a
        plaintext channel can carry it too, for loopback deployments without TLS)."""
        mod: Any = grpc.aio if aio else grpc
        if not self.tls:
            return mod.insecure_channel(address, options=options)
        creds = grpc.ssl_channel_credentials(_read(self.tls_ca, "TLS CA"), _read(self.tls_key, "TLS key"),
                                             _read(self.tls_cert, "TLS certificate"))
        return mod.secure_channel(address, creds, options=options)

    def ssl_context(self) -> ssl.SSLContext | None:
        """For HTTPS to the side port; None: plain HTTP."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=str(self.tls_ca))
        if self.tls_cert:
            ctx.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        return ctx


# --- the server's token check ------------------------------------------------------------------------------------


def _refusal(kind: str, message: str, on_refuse: Callable[[], None]) -> grpc.RpcMethodHandler[Any, Any]:
    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        on_refuse()
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        on_refuse()
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield b""  # pragma: no cover (makes this an async generator; abort raises first)

    def raw(b: bytes) -> bytes:
        return b

    if kind == "unary_unary":
        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=raw, response_serializer=raw)
    if kind == "unary_stream":
        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=raw, response_serializer=raw)
    if kind == "stream_unary":
        return grpc.stream_unary_rpc_method_handler(unary, request_deserializer=raw, response_serializer=raw)
    return grpc.stream_stream_rpc_method_handler(stream, request_deserializer=raw, response_serializer=raw)


def _presented(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]  # not subscriptable at runtime
    """Refuses every call (the service, reflection, anything) without the job secret or a credential derived from
    it: UNAUTHENTICATED, before the request is even parsed, so a refused call changes nothing. What an
    authenticated caller may do is the handlers' check (``Authority``)."""

    def __init__(self, token: str, on_refuse: Callable[[], None] = lambda: None) -> None:
        self._token = token
        self._on_refuse = on_refuse

    async def intercept_service(self, continuation: Callable[[Any], Any],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        presented = _presented(handler_call_details.invocation_metadata)
        handler: grpc.RpcMethodHandler[Any, Any] = await continuation(handler_call_details)
        if principal_of(self._token, presented) is not None:
            return handler
        message = ("missing job token: send 'authorization: Bearer <token or credential>' (fthsdp --token-file)"
                   if not presented else "wrong job token or credential")
        if handler is None:
            return _refusal("unary_unary", message, self._on_refuse)
        kind = ("stream" if handler.request_streaming else "unary") + "_" + \
               ("stream" if handler.response_streaming else "unary")
        return _refusal(kind, message, self._on_refuse)


class Authority:
    """The handlers' side of the check: who the caller is (from its call's metadata) and whether it may make this
    call (``credentials.refusal``): a replica's credential speaks for that replica only, a reader's reads. Without
    a job secret everyone may do everything (loopback only)."""

    def __init__(self, secret: str | None, on_refuse: Callable[[str], None] = lambda method: None) -> None:
        self.secret = secret
        self._on_refuse = on_refuse

    async def check(self, context: grpc.aio.ServicerContext[Any, Any], method: str, job: str,
                    replica: str = "") -> None:
        """Aborts the call with PERMISSION_DENIED (nothing changed) unless its caller may call ``method`` on
        ``job`` as ``replica``."""
        if self.secret is None:
            return
        who = principal_of(self.secret, _presented(context.invocation_metadata()))
        why = "not authenticated" if who is None else credentials.refusal(who, method, job, replica)
        if why is not None:
            self._on_refuse(method)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
