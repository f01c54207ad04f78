"""A shared pool's actors and secrets in Ray (docs/replicas.md).

A pool named ``cluster_name`` lives in the Ray namespace ``pdserve-<cluster_name>``: its workers
are named, detached actors (``prefill-0``, ``decode-0``, ..., ``embedding-0``) that whoever starts
first creates and everyone after finds (Ray's ``get_if_exists``, atomic per name), and its KV
plane's credentials are one set in Ray's GCS store (plain JSON: reading them runs no code), put
once by the first starter (put-if-absent), so workers created by two coordinators starting at the
same moment still trust each other.
Stopping the pool drops both. Without a namespace (a coordinator's own workers) there is nothing
to share: the actors are anonymous and the credentials fresh at every start.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.experimental import internal_kv

from engine.errors import ConfigError
from engine.transfer.credentials_format import (
    CredentialsFormatError,
    credentials_from_json,
    credentials_to_json,
)
from engine.transfer.security import ClusterCredentials, generate_credentials

POOL_CREDENTIALS = b"kv-credentials"  # the key of a pool's credentials in its namespace


def actor_options(namespace: str | None, name: str) -> dict[str, Any]:
    """Ray options that make an actor the pool's ``name`` (found if it exists, else started
    detached), or none for a coordinator's own workers (``namespace`` None)."""
    if namespace is None:
        return {}
    return {"name": name, "namespace": namespace, "lifetime": "detached", "get_if_exists": True}


def pool_credentials(namespace: str | None) -> ClusterCredentials:
    """The KV plane's credentials for workers about to be created: the pool's (the first
    starter's), or fresh ones without a pool. They are stored as plain JSON
    (``engine.transfer.credentials_format``); a stored value that is not is a ConfigError."""
    fresh = generate_credentials()
    if namespace is None:
        return fresh
    internal_kv._internal_kv_put(
        POOL_CREDENTIALS, credentials_to_json(fresh), overwrite=False, namespace=namespace
    )
    stored = internal_kv._internal_kv_get(POOL_CREDENTIALS, namespace=namespace)
    if stored is None:
        return fresh
    try:
        return credentials_from_json(stored)
    except CredentialsFormatError as exc:
        raise ConfigError(
            f"the KV credentials of pool namespace {namespace} in Ray's GCS "
            f"({POOL_CREDENTIALS.decode()}) are unreadable: {exc}; `pdserve workers --stop` "
            "drops them with the pool's workers"
        ) from None


def drop_credentials(namespace: str) -> None:
    internal_kv._internal_kv_del(POOL_CREDENTIALS, namespace=namespace)


def stop_pool(namespace: str, names: list[str]) -> list[str]:
    """Stop the pool's actors of ``names`` that are running, and drop its credentials; the
    names of those stopped."""
    stopped = []
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=namespace)
        except ValueError:  # not running
            continue
        ray.kill(actor, no_restart=True)
        stopped.append(name)
    drop_credentials(namespace)
    return stopped
