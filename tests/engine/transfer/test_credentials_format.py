"""The KV credentials' stored form (``engine/transfer/credentials_format.py``): plain JSON that
reads back to the same credentials, and a stored value of any other shape, a pickle included, is
refused without running anything."""

from __future__ import annotations

import base64
import json
import os
import pickle
from pathlib import Path

import pytest

from engine.transfer.credentials_format import (
    CredentialsFormatError,
    credentials_from_json,
    credentials_to_json,
)
from engine.transfer.security import generate_credentials

CREDENTIALS = generate_credentials()


def _document() -> dict:
    return json.loads(credentials_to_json(CREDENTIALS))


def test_credentials_read_back_equal_and_the_text_is_json_of_base64():
    stored = credentials_to_json(CREDENTIALS)
    assert credentials_from_json(stored) == CREDENTIALS
    document = json.loads(stored)
    assert document["format"] == "pdserve-kv-credentials/1"
    secret = base64.b64decode(document["receiver"]["curve_secret"])
    assert secret == CREDENTIALS.receiver.curve_secret


class _Planted:
    """Unpickling this would create ``path``: what a crafted stored value could do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


def test_a_pickle_is_refused_and_never_run(tmp_path):
    planted = tmp_path / "ran"
    with pytest.raises(CredentialsFormatError, match="not JSON"):
        credentials_from_json(pickle.dumps(_Planted(planted)))
    assert not planted.exists()
    with pytest.raises(CredentialsFormatError, match="not JSON"):
        credentials_from_json(pickle.dumps(CREDENTIALS))


def _with(change) -> bytes:
    document = _document()
    change(document)
    return json.dumps(document).encode()


@pytest.mark.parametrize(
    ("stored", "message"),
    [
        (b"[]", "not a JSON object with format"),
        (_with(lambda d: d.update(format="pdserve-kv-credentials/0")), "format"),
        (_with(lambda d: d.update(extra=1)), "keys must be format, receiver, sender"),
        (_with(lambda d: d.pop("sender")), "keys must be format, receiver, sender"),
        (_with(lambda d: d.update(sender="x")), "sender must hold exactly curve_public"),
        (_with(lambda d: d["receiver"].pop("tls_key")), "receiver must hold exactly"),
        (_with(lambda d: d["receiver"].update(tls_key="not base64!")), "receiver.tls_key is not"),
        (_with(lambda d: d["sender"].update(plain_password=7)), "sender.plain_password is not"),
    ],
)
def test_anything_else_is_a_clear_error(stored, message):
    with pytest.raises(CredentialsFormatError, match=message):
        credentials_from_json(stored)
