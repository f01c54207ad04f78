"""Encryption and peer authentication of the KV plane.

The cluster makes fresh credentials at every start (:func:`generate_credentials`) and hands each
role its share with the actor's arguments: a decode worker (the receiver) gets its own secrets
and what identifies the only senders it admits; a prefill worker (the sender) gets its own
secrets and what identifies the receivers it may talk to. Nothing is written to disk.

- ZMQ: CURVE. Receivers share one key pair, senders another. A sender connects with the
  receivers' public key (only a holder of their secret completes the handshake); a receiver's
  ZAP handler admits only the senders' public key. The traffic is encrypted either way.
- gRPC: TLS 1.3 with a certificate authority of the cluster's own. The receivers' certificate
  is for the name ``KV_TLS_NAME`` (endpoints are IPs that change with every pod, so the sender
  checks that name instead), and a receiver requires a client certificate from the same CA.

A plaintext plane (``kv_encryption`` off, or ``auto`` on loopback) still admits only the
cluster's senders on ZMQ when the cluster handed its workers credentials: the ZMQ PLAIN
mechanism with a per-start password (:meth:`KVCredentials.plaintext_gate`). It encrypts
nothing, but a stranger (another process of the host) never gets a message in, so it cannot
make a receiver buffer one endless multipart message either.

Shared-memory hand-offs on one host stay as they are: the file is the sender's, mode 0600, and
only its name crosses the (authenticated) socket.
"""

from __future__ import annotations

import datetime
import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from engine.errors import ConfigError

if TYPE_CHECKING:
    from engine.config import KVTransferConfig

log = logging.getLogger(__name__)
KV_TLS_NAME = "pdserve-kv"  # the name in the receivers' certificate, checked by senders
_VALID_FOR = datetime.timedelta(days=3650)  # the credentials live as long as the cluster start
_CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=False,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


@dataclass(frozen=True)
class KVCredentials:
    """One role's share: its own CURVE key pair and TLS certificate, and its peers' identity."""

    curve_public: bytes = field(repr=False)  # this role's key pair (Z85)
    curve_secret: bytes = field(repr=False)
    curve_peer_public: bytes = field(repr=False)  # the other role's public key
    tls_ca: bytes = field(repr=False)  # PEM: the cluster's CA, which signed both certificates
    tls_certificate: bytes = field(repr=False)  # PEM: this role's certificate
    tls_key: bytes = field(repr=False)  # PEM: its private key
    plain_password: bytes = field(default=b"", repr=False)  # ZMQ PLAIN, plaintext planes

    @property
    def encrypts(self) -> bool:
        """Whether these credentials encrypt (CURVE / TLS), not only admit (PLAIN)."""
        return bool(self.curve_secret or self.tls_key)

    def plaintext_gate(self) -> KVCredentials | None:
        """The share a plaintext plane uses: only the PLAIN password (None without one)."""
        if not self.plain_password:
            return None
        return KVCredentials(b"", b"", b"", b"", b"", b"", self.plain_password)


@dataclass(frozen=True)
class ClusterCredentials:
    receiver: KVCredentials  # for decode workers
    sender: KVCredentials  # for prefill workers


def generate_credentials() -> ClusterCredentials:
    """Fresh credentials for one cluster start."""
    receiver_public, receiver_secret = zmq.curve_keypair()
    sender_public, sender_secret = zmq.curve_keypair()
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("pdserve KV CA", ca_key.public_key(), ca_key, None, is_ca=True)
    receiver_key = ec.generate_private_key(ec.SECP256R1())
    sender_key = ec.generate_private_key(ec.SECP256R1())
    receiver_cert = _certificate(KV_TLS_NAME, receiver_key.public_key(), ca_key, ca, server=True)
    sender_cert = _certificate("pdserve KV sender", sender_key.public_key(), ca_key, ca)
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    password = secrets.token_hex(32).encode()

    def share(
        curve: tuple[bytes, bytes, bytes], cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
    ) -> KVCredentials:
        """A role's share: its CURVE keys (its public, its secret, its peers' public), the CA,
        its certificate and its key, and the cluster's PLAIN password."""
        tls = (ca_pem, cert.public_bytes(serialization.Encoding.PEM), _pem(key))
        return KVCredentials(*curve, *tls, password)

    return ClusterCredentials(
        receiver=share(
            (receiver_public, receiver_secret, sender_public), receiver_cert, receiver_key
        ),
        sender=share((sender_public, sender_secret, receiver_public), sender_cert, sender_key),
    )


def transfer_credentials(
    transfer: KVTransferConfig, credentials: KVCredentials | None
) -> KVCredentials | None:
    """The credentials a worker's transport uses: ``credentials`` when ``transfer`` is
    encrypted (a ConfigError if there are none: never fall back to plain text), else their
    plaintext gate (None without credentials).
    A plane left in plain text off loopback (allowed explicitly) is warned about, once a
    worker."""
    if transfer.plaintext_off_loopback:
        log.warning(
            "KV PLANE IN PLAIN TEXT off loopback (kv_encryption %r, kv_host %r, "
            "kv_allow_plaintext_off_loopback: true): any host on the path can read the KV "
            "pages and reservation secrets and deliver forged pages",
            transfer.encryption,
            transfer.host,
        )
    if not transfer.encrypted:
        return None if credentials is None else credentials.plaintext_gate()
    if credentials is None:
        raise ConfigError(
            "the KV plane is encrypted (kv_encryption "
            f"{transfer.encryption!r}, kv_host {transfer.host!r}) but this worker got no "
            "credentials"
        )
    return credentials


def _certificate(
    name: str,
    public_key: ec.EllipticCurvePublicKey,
    ca_key: ec.EllipticCurvePrivateKey,
    ca: x509.Certificate | None,
    *,
    is_ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.subject if ca is not None else subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALID_FOR)
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if is_ca:
        builder = builder.add_extension(_CA_KEY_USAGE, critical=True)
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(KV_TLS_NAME)]), critical=False
        )
    return builder.sign(ca_key, hashes.SHA256())


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
