"""Writes the coordinator's ms_coordinator.json with the API keys of the chart's Secrets.

Usage: python compose_config.py CONFIG TARGET [--api-keys FILE] [--manage-api-keys FILE].
Each FILE holds one key per line (blank lines ignored) and becomes http_config.api_keys or
http_config.manage_api_keys; TARGET is written with mode 0600, in the pod's private /tmp.
"""

import argparse
import json
import os
import sys


def read_keys(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        keys = [line.strip() for line in f if line.strip()]
    if not keys:
        sys.exit(f"compose_config: {path} holds no API key")
    return keys


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="compose_config.py")
    parser.add_argument("config")
    parser.add_argument("target")
    parser.add_argument("--api-keys")
    parser.add_argument("--manage-api-keys")
    args = parser.parse_args(argv)
    with open(args.config, encoding="utf-8") as f:
        config = json.load(f)
    http = config.setdefault("http_config", {})
    if args.api_keys:
        http["api_keys"] = read_keys(args.api_keys)
    if args.manage_api_keys:
        http["manage_api_keys"] = read_keys(args.manage_api_keys)
    os.makedirs(os.path.dirname(args.target) or ".", exist_ok=True)
    fd = os.open(args.target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
