"""A shared pool's KV credentials (``Cluster._credentials``): coordinators that start the same
pool at once must hand its prefill and decode workers one set, or a decode worker created by one
would refuse the pages of a prefill worker created by the other. The first starter's set is put
once into Ray's GCS store; ``stop_pool`` drops it with the workers. A private cluster's are its
own. (Two coordinators racing to create a pool with encryption on, end to end:
``tests/multihost/test_replicas_across_hosts.py``.)"""

from __future__ import annotations

import pytest

from coordinator.cluster import Cluster
from coordinator.cluster_config import ClusterConfig

pytestmark = pytest.mark.ray


def test_starters_of_one_pool_share_its_credentials_and_stopping_drops_them(ray_session):
    pool = ClusterConfig(cluster_name="credentials-test", embedding_model_path=None)
    first, second = Cluster(pool), Cluster(pool)
    shared = first._credentials()
    assert second._credentials() == shared
    other_pool = Cluster(ClusterConfig(cluster_name="another-pool", embedding_model_path=None))
    assert other_pool._credentials() != shared
    private = Cluster(ClusterConfig(embedding_model_path=None))
    assert private._credentials() != private._credentials()  # fresh at every start
    assert first.stop_pool() == []  # no worker was started; the credentials go all the same
    assert Cluster(pool)._credentials() != shared
    Cluster(pool).stop_pool()
    other_pool.stop_pool()
