"""The elastic pool's settings: ``max_workers`` only with elastic workers of a private pool,
and never below the workers it starts with."""

from __future__ import annotations

import pytest

from coordinator.config.cluster import ClusterConfig
from engine.errors import ConfigError


def test_max_workers_bounds_a_private_elastic_pool():
    assert ClusterConfig(elastic_roles=True, num_decode=2, max_workers=3).max_workers == 3
    assert ClusterConfig(elastic_roles=True).max_workers == 0  # a fixed pool
    with pytest.raises(ConfigError, match="max_workers needs elastic_roles"):
        ClusterConfig(max_workers=4)
    with pytest.raises(ConfigError, match=r"at least .* \(3\), got 2"):
        ClusterConfig(elastic_roles=True, num_decode=2, max_workers=2)
    with pytest.raises(ConfigError, match="needs a private pool"):
        ClusterConfig(elastic_roles=True, max_workers=4, cluster_name="shared")
    with pytest.raises(ConfigError, match="max_workers"):
        ClusterConfig(elastic_roles=True, max_workers=5000)
