"""How a coordinator connects to Ray: a local Ray of its own, or a cluster it joins.

A local Ray otherwise binds its services to the host's external address. Ray reads
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when it is imported, so the flag it derived is set too; the
processes it starts inherit the variable. A local Ray runs none of Ray's services that pdserve
does not use (``local_ray_services.py``). Joining a cluster, the coordinator attaches to this host's
own raylet where the machine shows several (``ray_node.py``).
"""

from __future__ import annotations

import os
from typing import Any

import ray

from coordinator.local_ray_services import without_unused_services
from coordinator.ray_node import own_node_ip


def init_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Connect to ``address``, or start a local Ray bound to 127.0.0.1 (module docstring).
    True if started here."""
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if address is None:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
        # "local": a Ray of our own even when another one runs on this machine (never join it
        # unasked: that is what --ray-address auto is for).
        with without_unused_services():
            ray.init(address="local", num_cpus=num_cpus, **kwargs)
        return True
    node_ip = own_node_ip(address)
    if node_ip is not None:
        kwargs["_node_ip_address"] = node_ip
    ray.init(address=address, **kwargs)
    return False
