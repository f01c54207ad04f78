"""``ClusterCredentials`` as plain JSON, for a store other processes read (a shared pool's set in
Ray's GCS, ``coordinator/pool/shared.py``).

The text is data only: a format tag and, for each role (``receiver``, ``sender``), every field
of :class:`KVCredentials` as base64. Reading it builds the dataclasses field by field, so a
stored value can never run code (as unpickling one could), and anything else, a missing or extra
field, a field that is not base64, another format, is a :class:`CredentialsFormatError`.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import asdict, fields
from typing import Any

from engine.transfer.security import ClusterCredentials, KVCredentials

FORMAT = "pdserve-kv-credentials/1"
ROLES = ("receiver", "sender")
FIELDS = tuple(f.name for f in fields(KVCredentials))


class CredentialsFormatError(ValueError):
    """Stored credentials that are not this module's format."""


def credentials_to_json(credentials: ClusterCredentials) -> bytes:
    """``credentials`` as UTF-8 JSON text (bytes fields in base64)."""
    document: dict[str, Any] = {"format": FORMAT}
    for role in ROLES:
        share = asdict(getattr(credentials, role))
        document[role] = {name: base64.b64encode(share[name]).decode() for name in FIELDS}
    return json.dumps(document, sort_keys=True).encode()


def credentials_from_json(stored: bytes) -> ClusterCredentials:
    """The credentials ``stored`` holds; a CredentialsFormatError saying what is wrong when it is
    not exactly what :func:`credentials_to_json` writes."""
    try:
        document = json.loads(stored)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CredentialsFormatError(f"not JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CredentialsFormatError(f"not a JSON object with format {FORMAT!r}")
    if set(document) != {"format", *ROLES}:
        raise CredentialsFormatError(f"keys must be format, {', '.join(ROLES)}: {sorted(document)}")
    shares = {role: _share(role, document[role]) for role in ROLES}
    return ClusterCredentials(**shares)


def _share(role: str, entry: Any) -> KVCredentials:
    if not isinstance(entry, dict) or set(entry) != set(FIELDS):
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise CredentialsFormatError(f"{role} must hold exactly {', '.join(FIELDS)}; got {got}")
    values = {}
    for name in FIELDS:
        text = entry[name]
        try:
            if not isinstance(text, str):
                raise TypeError
            values[name] = base64.b64decode(text, validate=True)
        except (TypeError, ValueError, binascii.Error):
            raise CredentialsFormatError(f"{role}.{name} is not a base64 string") from None
    return KVCredentials(**values)
