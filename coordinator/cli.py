"""The ``pdserve`` command: start the coordinator and its worker cluster.

Each option overrides one key of ``ms_coordinator.json`` (``--config`` or
``$MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH``) and its ``PDSERVE_<SECTION>__<KEY>`` environment
variable, which overrides the file, which overrides the built-in defaults; ``--help`` names the
key and the default of every option. MindIE's positional form ``pdserve PREDICT_IP
PREDICT_PORT MANAGE_IP MANAGE_PORT`` is accepted too. A bad configuration is one line on stderr
and exit code 2. docs/configuration.md lists every key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any

from coordinator.config.loader import (
    CONFIG_PATH_ENV,
    SCHEMA,
    CoordinatorConfig,
    check_manage_listener,
    load_config,
)
from coordinator.memory_check import check_body_budget, check_request_room, memory_limit_bytes
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
    "cluster_name": "backend_config.cluster_name",
    "model_config": "backend_config.model_config",
}
POSITIONAL = ("predict_ip", "predict_port", "manage_ip", "manage_port")

USAGE = """%(prog)s [options]
       %(prog)s [options] PREDICT_IP [PREDICT_PORT [MANAGE_IP [MANAGE_PORT]]]"""
DESCRIPTION = """\
Start the pdserve coordinator and its prefill/decode worker cluster.

With no arguments: a local Ray, the bundled SmolLM2-135M-Instruct model, one prefill and one
decode actor, and the inference API over plain HTTP on 127.0.0.1:1025 (management on 1026,
metrics on 1028, health probes on 1029)."""
EPILOG = f"""\
Precedence: options > environment variables > the configuration file > built-in defaults.
The file is --config, else ${CONFIG_PATH_ENV}. Every key
(status and metrics ports, TLS, request limits, timeouts, engine limits) is set in the file or
by the variable PDSERVE_<SECTION>__<KEY>, e.g. PDSERVE_BACKEND_CONFIG__MAXSEQLEN=4096:
see docs/configuration.md. A bad value is one line on stderr naming the key, its valid range
and the value received, and exit code 2.

examples:
  pdserve
  pdserve --config ms_coordinator.json --predict-port 8080
  pdserve --model ./my-llama-dir --deploy-mode single_node
  pdserve --ray-address auto --prefill 2 --decode 2 --kv-transport grpc
  pdserve --ray-address HEAD:6379 --cluster-name prod   (one of several coordinators)
  pdserve 127.0.0.1 1025 127.0.0.1 1026      (MindIE's positional form)
  pdserve workers --config ms_coordinator.json   (a shared worker pool alone: --help)"""

# option -> (metavar, what it sets); the range, the default and the config key come from SCHEMA
OPTIONS = {
    "predict_ip": ("IP", "address of the inference API"),
    "predict_port": ("PORT", "port of the inference API"),
    "manage_ip": (
        "IP",
        "address of the management API (GET /v1/instances); other than loopback it needs "
        "http_config.manage_api_keys",
    ),
    "manage_port": ("PORT", "port of the management API"),
    "model": (
        "PATH",
        "generative model: 'bundled', a Hugging Face model directory, a .gguf file or an "
        "MLflow model directory",
    ),
    "deploy_mode": (
        "MODE",
        "pd_separate (prefill and decode actors, KV hand-off) or single_node (one engine)",
    ),
    "prefill": ("N", "prefill actors in pd_separate mode"),
    "decode": ("N", "decode actors in pd_separate mode"),
    "kv_transport": ("NAME", "KV cache hand-off between prefill and decode: zmq or grpc"),
    "ray_address": ("ADDR", "join this Ray cluster ('auto' from inside one, or ray://HOST:PORT)"),
    "cluster_name": (
        "NAME",
        "serve from the shared worker pool of this name, with any other coordinator of it "
        "(docs/replicas.md)",
    ),
    "model_config": (
        "JSON",
        "MLflow models: a JSON object overriding keys of the saved model_config",
    ),
}
DEFAULT_TEXT = {  # where the raw default would say nothing
    "ray_address": "none: start a local Ray",
    "model_config": "none: the saved model_config",
    "cluster_name": "none: this coordinator's own workers",
}


def option_help(option: str) -> str:
    """What ``option`` sets, its built-in default and the configuration key it overrides."""
    key = OVERRIDES[option]
    section, name = key.split(".")
    spec = SCHEMA[section][name]
    what = OPTIONS[option][1]
    if spec.low is not None and spec.high is not None:
        what += f", {int(spec.low)}-{int(spec.high)}"
    default = DEFAULT_TEXT.get(option, spec.default)
    return f"{what} (default: {default}; config key {key})"


def version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        usage=USAGE,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "positional",
        nargs="*",
        metavar="ADDRESS",
        help="MindIE's positional form: PREDICT_IP PREDICT_PORT MANAGE_IP MANAGE_PORT, any "
        "number from the left; a named option wins over its positional value",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {version()}", help="print the version"
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        help=f"the ms_coordinator.json to read (default: ${CONFIG_PATH_ENV} when set, else "
        "none: built-in defaults)",
    )
    types: dict[str, Callable[[str], Any]] = {
        "prefill": int,
        "decode": int,
        "model_config": _json_object,
    }
    for option, (metavar, _) in OPTIONS.items():
        section, name = OVERRIDES[option].split(".")
        parser.add_argument(
            "--" + option.replace("_", "-"),
            metavar=metavar,
            type=types.get(option, str),
            choices=SCHEMA[section][name].choices or None,
            help=option_help(option),
        )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
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


def event_loop_factory(config: CoordinatorConfig) -> Callable[[], asyncio.AbstractEventLoop]:
    """The coordinator's event loop, as ``http_config.event_loop`` names it."""
    if config["http_config"]["event_loop"] == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["workers"]:  # the shared worker pool alone (docs/replicas.md)
        from coordinator.pool.command import main as workers_main

        return workers_main(argv[1:])
    args = parse_args(argv)
    try:
        config = resolve_config(args)
        check_manage_listener(config)
        pod_memory = memory_limit_bytes()
        check_body_budget(config, pod_memory)
        check_request_room(config, pod_memory)
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
    with asyncio.Runner(loop_factory=event_loop_factory(config)) as runner:
        return runner.run(coordinator.serve())


if __name__ == "__main__":
    sys.exit(main())
