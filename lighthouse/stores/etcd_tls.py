"""How a lighthouse reaches an etcd that serves TLS and requires client certificates (``--client-cert-auth``):
the options, checked when given, and the gRPC credentials made from their files. Kept apart from the etcd client
so that reading the options (``lighthouse.config.etcd_tls_from_env``) does not import pyetcd."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from lighthouse.errors import SecurityConfigError

ENV_ETCD_CA = "FTHSDP_ETCD_CA"
ENV_ETCD_CERT = "FTHSDP_ETCD_CERT"
ENV_ETCD_KEY = "FTHSDP_ETCD_KEY"
"""The environment equivalents of ``fthsdp lighthouse --etcd-ca/--etcd-cert/--etcd-key`` (flags win)."""


@dataclass(frozen=True)
class EtcdTLS:
    """TLS to etcd: ``ca`` (PEM) verifies the members' server certificates, whose names must cover the hosts of
    the URL; ``cert``/``key`` (PEM, both or neither) are this lighthouse's client certificate, which an etcd run
    with ``--client-cert-auth --trusted-ca-file`` requires. Files are read when a client is made."""

    ca: str
    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        if not self.ca:
            raise SecurityConfigError("etcd TLS needs the CA certificate that signed etcd's (--etcd-ca)")
        if bool(self.cert) != bool(self.key):
            raise SecurityConfigError("etcd client certificate and key go together (--etcd-cert and --etcd-key)")

    @classmethod
    def from_options(cls, ca: str | None, cert: str | None, key: str | None) -> EtcdTLS | None:
        """None when no option is set (plaintext); a ``SecurityConfigError`` when they do not fit together."""
        if not (ca or cert or key):
            return None
        return cls(ca or "", cert or "", key or "")

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials from the files; a ``SecurityConfigError`` naming an unreadable one."""

        def read(path: str, what: str) -> bytes | None:
            if not path:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise SecurityConfigError(f"cannot read the etcd {what} {path!r}: {e.strerror}") from None

        return grpc.ssl_channel_credentials(read(self.ca, "CA certificate (--etcd-ca)"),
                                            read(self.key, "client key (--etcd-key)"),
                                            read(self.cert, "client certificate (--etcd-cert)"))
