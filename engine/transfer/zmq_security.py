"""ZMQ sockets secured with a role's :class:`KVCredentials` (the rules are security.py's).

A server (the side that binds: a KV receiver, a worker's token channel) calls
:func:`admit_only` on a context of its own, then :func:`secure_server` on its socket; a client
(the side that connects: a KV sender, a coordinator's token streams) calls
:func:`secure_client` before ``connect``. With encrypting credentials that is CURVE (the server
with its role's key pair, admitting only the other role's public key; the client with its
pair, trusting only the server's public key); with a plaintext gate (a password only) it is
PLAIN with the cluster's password; without credentials (None) ZMQ's NULL mechanism, which
admits anyone.
"""

from __future__ import annotations

import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

from engine.transfer.security import KVCredentials

log = logging.getLogger(__name__)
PLAIN_USER = "pdserve-kv"


class _AdmittedKeys:
    """ZAP credentials provider: the CURVE public keys a server admits."""

    def __init__(self, keys: set[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._keys


def admit_only(context: zmq.Context, credentials: KVCredentials) -> ThreadAuthenticator:
    """Start ``context``'s ZAP handler, admitting only the other role: CURVE clients with its
    public key, or (a plaintext gate) PLAIN clients with the cluster's password."""
    authenticator = ThreadAuthenticator(context, log=log)
    authenticator.start()
    if credentials.encrypts:
        authenticator.configure_curve_callback("*", _AdmittedKeys({credentials.curve_peer_public}))
    else:
        authenticator.configure_plain("*", {PLAIN_USER: credentials.plain_password.decode()})
    return authenticator


def secure_server(socket: zmq.Socket, credentials: KVCredentials | None) -> None:
    """Make ``socket`` (before ``bind``) a CURVE or PLAIN server; None: left as it is."""
    if credentials is not None and credentials.encrypts:
        socket.curve_secretkey = credentials.curve_secret
        socket.curve_publickey = credentials.curve_public
        socket.curve_server = True
    elif credentials is not None:  # plain text, but only the cluster's peers get in
        socket.plain_server = True


def secure_client(socket: zmq.Socket, credentials: KVCredentials | None) -> None:
    """Make ``socket`` (before ``connect``) a CURVE client trusting only the other role's
    public key, or a PLAIN client with the cluster's password; None: left as it is."""
    if credentials is not None and credentials.encrypts:
        socket.curve_secretkey = credentials.curve_secret
        socket.curve_publickey = credentials.curve_public
        socket.curve_serverkey = credentials.curve_peer_public
    elif credentials is not None:
        socket.plain_username = PLAIN_USER.encode()
        socket.plain_password = credentials.plain_password
