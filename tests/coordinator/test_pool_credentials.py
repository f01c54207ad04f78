"""A shared pool's KV credentials (``coordinator/pool/shared.py``): coordinators that start the
same pool at once must hand its prefill and decode workers one set, or a decode worker created by
one would refuse the pages of a prefill worker created by the other. The first starter's set is
put once into Ray's GCS store; stopping the pool drops it with the workers. A private cluster's
are its own. (Two coordinators racing to create a pool with encryption on, end to end:
``tests/multihost/test_replicas_across_hosts.py``.)"""

from __future__ import annotations

import json
import pickle

import pytest
from ray.experimental import internal_kv

from coordinator.config.cluster import ClusterConfig
from coordinator.pool.fleet import Fleet
from coordinator.pool.shared import POOL_CREDENTIALS, drop_credentials, pool_credentials
from engine.errors import ConfigError

pytestmark = pytest.mark.ray


def test_starters_of_one_pool_share_its_credentials_and_stopping_drops_them(ray_session):
    namespace = "pdserve-credentials-test"
    shared = pool_credentials(namespace)
    assert pool_credentials(namespace) == shared  # a second starter gets the first one's
    assert pool_credentials("pdserve-another-pool") != shared
    assert pool_credentials(None) != pool_credentials(None)  # private: fresh at every start
    pool = Fleet(ClusterConfig(cluster_name="credentials-test", embedding_model_path=None))
    assert pool.config.namespace == namespace
    assert pool.stop_pool() == []  # no worker was started; the credentials go all the same
    assert pool_credentials(namespace) != shared
    pool.stop_pool()
    Fleet(ClusterConfig(cluster_name="another-pool", embedding_model_path=None)).stop_pool()
    with pytest.raises(ValueError, match="needs a cluster_name"):
        Fleet(ClusterConfig(embedding_model_path=None)).stop_pool()


def test_the_stored_set_is_plain_json_and_an_unreadable_one_is_refused(ray_session):
    """What sits in the GCS is JSON, not a pickle; a value there that is not the format (a pickle
    an older or hostile writer left) stops the start with a clear error instead of being run."""
    namespace = "pdserve-credentials-format-test"
    shared = pool_credentials(namespace)
    stored = internal_kv._internal_kv_get(POOL_CREDENTIALS, namespace=namespace)
    assert json.loads(stored)["format"] == "pdserve-kv-credentials/1"
    drop_credentials(namespace)
    internal_kv._internal_kv_put(POOL_CREDENTIALS, pickle.dumps(shared), namespace=namespace)
    try:
        with pytest.raises(ConfigError, match=f"pool namespace {namespace} .* not JSON"):
            pool_credentials(namespace)
    finally:
        drop_credentials(namespace)
