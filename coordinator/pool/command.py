"""``pdserve workers``: start (or stop) a shared pool of worker actors, with no coordinator.

The pool is the one ``backend_config.cluster_name`` names, on the Ray cluster at
``backend_config.ray_address`` (both needed: a pool on a Ray started here would end with this
command). Its actors are named and detached, so they stay up after the command exits, and every
coordinator configured with the same name finds them (docs/replicas.md). ``--stop`` stops them.
The configuration is the coordinators' own ``ms_coordinator.json``: the pool's model, counts and
resources come from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from coordinator.config.loader import CONFIG_PATH_ENV, load_config
from engine.errors import ConfigError, EngineError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve workers",
        description="Start the shared worker pool named by backend_config.cluster_name, on the "
        "Ray cluster at backend_config.ray_address, and exit once every worker has loaded its "
        "model (the workers stay up); --stop stops them.",
    )
    parser.add_argument(
        "--config", metavar="PATH", help=f"the ms_coordinator.json (default: ${CONFIG_PATH_ENV})"
    )
    parser.add_argument("--ray-address", metavar="ADDR", help="backend_config.ray_address")
    parser.add_argument("--cluster-name", metavar="NAME", help="backend_config.cluster_name")
    parser.add_argument("--stop", action="store_true", help="stop the pool's workers")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config).with_overrides(
            {
                "backend_config.ray_address": args.ray_address,
                "backend_config.cluster_name": args.cluster_name,
            }
        )
        backend = config["backend_config"]
        if not backend["cluster_name"] or not backend["ray_address"]:
            raise ConfigError(
                "pdserve workers needs backend_config.cluster_name and backend_config."
                f"ray_address, got {backend['cluster_name']!r} and {backend['ray_address']!r}"
            )
    except ConfigError as exc:
        print(f"pdserve workers: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from coordinator.pool.fleet import Fleet
    from coordinator.ray_connect import init_ray
    from coordinator.served_model import cluster_config, served_models

    try:
        fleet = Fleet(cluster_config(config, served_models(config)))
    except EngineError as exc:
        print(f"pdserve workers: {exc}", file=sys.stderr)
        return 2
    init_ray(backend["ray_address"])
    if args.stop:
        stopped = fleet.stop_pool()
        print(json.dumps({"cluster_name": backend["cluster_name"], "stopped": stopped}))
        return 0
    fleet.start()
    print(json.dumps({"cluster_name": backend["cluster_name"], "workers": fleet.describe()}))
    return 0
