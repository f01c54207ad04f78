"""``pdserve``: start the coordinator and its worker cluster.

    pdserve [--config PATH] [--predict-ip IP] [--predict-port PORT] [--manage-ip IP]
            [--manage-port PORT] [--model PATH] [--deploy-mode pd_separate|single_node]
            [--prefill N] [--decode M] [--kv-transport zmq|grpc] [--ray-address ADDR]
            [--model-config JSON]
    pdserve PREDICT_IP PREDICT_PORT MANAGE_IP MANAGE_PORT     (MindIE's positional form)

CLI values win over ``ms_coordinator.json`` (``--config`` or
``$MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH``), which wins over the defaults. With no arguments:
a local Ray, the bundled model, one prefill and one decode actor, HTTP on 127.0.0.1:1025.
A bad configuration is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from coordinator.config import CoordinatorConfig, load_config
from engine.errors import ConfigError, EngineError

OVERRIDES = {  # CLI option -> config key
    "predict_ip": "http_config.predict_ip",
    "predict_port": "http_config.predict_port",
    "manage_ip": "http_config.manage_ip",
    "manage_port": "http_config.manage_port",
    "model": "backend_config.model_path",
    "deploy_mode": "digs_scheduler_config.deploy_mode",
    "prefill": "backend_config.num_prefill_instances",
    "decode": "backend_config.num_decode_instances",
    "kv_transport": "backend_config.kv_transport",
    "ray_address": "backend_config.ray_address",
    "model_config": "backend_config.model_config",
}
POSITIONAL = ("predict_ip", "predict_port", "manage_ip", "manage_port")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "positional",
        nargs="*",
        metavar="PREDICT_IP PREDICT_PORT ...",
        help="MindIE's form: predict_ip predict_port manage_ip manage_port",
    )
    parser.add_argument("--config", help="path of ms_coordinator.json")
    parser.add_argument("--predict-ip")
    parser.add_argument("--predict-port")
    parser.add_argument("--manage-ip")
    parser.add_argument("--manage-port")
    parser.add_argument("--model", help="'bundled', a HF directory or a .gguf file")
    parser.add_argument("--deploy-mode", choices=("pd_separate", "single_node"))
    parser.add_argument("--prefill", type=int, help="prefill actors (pd_separate)")
    parser.add_argument("--decode", type=int, help="decode actors (pd_separate)")
    parser.add_argument("--kv-transport", choices=("zmq", "grpc"))
    parser.add_argument("--ray-address", help="join this Ray cluster ('auto' inside one)")
    parser.add_argument(
        "--model-config",
        type=_json_object,
        help="MLflow model: JSON object overriding keys of its saved model_config",
    )
    args = parser.parse_args(argv)
    if len(args.positional) > len(POSITIONAL):
        parser.error(f"at most {len(POSITIONAL)} positional values: {' '.join(POSITIONAL)}")
    for name, value in zip(POSITIONAL, args.positional, strict=False):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text}")
    return value


def resolve_config(args: argparse.Namespace) -> CoordinatorConfig:
    """File (or defaults), then the CLI on top; raises ConfigError naming the key."""
    overrides = {key: getattr(args, option) for option, key in OVERRIDES.items()}
    return load_config(args.config).with_overrides(overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = resolve_config(args)
    except ConfigError as exc:
        print(f"pdserve: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config["log_info"]["log_level"],
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from coordinator.server import Coordinator

    try:
        coordinator = Coordinator(config)
    except EngineError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    asyncio.run(coordinator.serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
