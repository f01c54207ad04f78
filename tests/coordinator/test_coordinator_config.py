"""ms_coordinator.json and the CLI: precedence, MindIE's positional form, clear errors, exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata

import pytest

from coordinator.cli import OVERRIDES, build_parser, parse_args, resolve_config
from coordinator.config.loader import CONFIG_PATH_ENV, SCHEMA, load_config
from engine.errors import ConfigError


def _write(tmp_path, config) -> str:
    path = tmp_path / "ms_coordinator.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_defaults_are_the_embedded_default():
    config = resolve_config(parse_args([]))
    http = config["http_config"]
    assert (http["predict_ip"], http["predict_port"], http["status_port"]) == (
        "127.0.0.1",
        1025,
        1029,
    )
    assert config["digs_scheduler_config"]["deploy_mode"] == "pd_separate"
    assert config["backend_config"]["model_path"] == "bundled"
    assert config["backend_config"]["num_prefill_instances"] == 1


def test_the_default_pd_separate_is_the_adaptive_one_measured_and_single_node_fills_steps(
    tmp_path,
):
    from coordinator.served_model import ServedModels, cluster_config, routing_config

    config = resolve_config(parse_args([]))
    cluster = cluster_config(config, ServedModels(None, None))
    routing = routing_config(config, cluster.engine)
    assert (routing.local_prefill_tokens, routing.local_prefill_queue_tokens) == (96, 1024)
    assert cluster.engine.scheduler.step_target_ms == 100
    single = {"digs_scheduler_config": {"deploy_mode": "single_node"}}
    config = resolve_config(parse_args(["--config", _write(tmp_path, single)]))
    assert cluster_config(config, ServedModels(None, None)).engine.scheduler.step_target_ms == 0
    pinned = {"backend_config": {"stepTargetMs": 0}}  # set in the file: kept in either mode
    config = resolve_config(parse_args(["--config", _write(tmp_path, pinned)]))
    assert cluster_config(config, ServedModels(None, None)).engine.scheduler.step_target_ms == 0


def test_a_prefill_engine_may_have_a_kv_cache_of_its_own(tmp_path):
    from coordinator.pool.fleet import Fleet
    from coordinator.served_model import ServedModels, cluster_config
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    sized = {"backend_config": {"kvCacheMemoryMB": 1440, "prefill_kv_cache_memory_mb": 360}}
    for given, prefill_mb in (({}, 1024), (sized, 360)):
        config = resolve_config(parse_args(["--config", _write(tmp_path, given)]))
        fleet = Fleet(cluster_config(config, ServedModels(None, None)))
        decode_mb = fleet.config.engine.cache.memory_mb
        assert fleet._cache_of(PrefillWorker).memory_mb == prefill_mb
        assert fleet._cache_of(DecodeWorker).memory_mb == decode_mb == (1440 if given else 1024)


def test_cli_wins_over_file_which_wins_over_defaults(tmp_path):
    path = _write(
        tmp_path,
        {
            "http_config": {"predict_port": "2000", "manage_port": 2001},
            "backend_config": {"kv_transport": "grpc", "maxIterTimes": 64},
        },
    )
    config = resolve_config(parse_args(["--config", path, "--predict-port", "3000"]))
    assert config["http_config"]["predict_port"] == 3000
    assert config["http_config"]["manage_port"] == 2001
    assert config["backend_config"]["kv_transport"] == "grpc"
    assert config["backend_config"]["maxIterTimes"] == 64
    assert config["http_config"]["status_port"] == 1029


def test_mindie_positional_form_and_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(CONFIG_PATH_ENV, _write(tmp_path, {"http_config": {"predict_port": 2000}}))
    config = resolve_config(parse_args(["127.0.0.2", "4000", "127.0.0.3", "4001"]))
    http = config["http_config"]
    assert (http["predict_ip"], http["predict_port"]) == ("127.0.0.2", 4000)
    assert (http["manage_ip"], http["manage_port"]) == ("127.0.0.3", 4001)
    assert resolve_config(parse_args([]))["http_config"]["predict_port"] == 2000


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"http_config": {"predict_port": 80}},
            "http_config.predict_port must be an integer in [1024, 65535], got 80",
        ),
        ({"http_config": {"predict_port": "abc"}}, "http_config.predict_port must be an integer"),
        (
            {"http_config": {"predict_ip": "localhost"}},
            "http_config.predict_ip must be an IP address",
        ),
        ({"http_config": {"predict_ip": "0.0.0.0"}}, "allow_all_zero_ip_listening"),
        (
            {"request_limit": {"max_requests": 0}},
            "request_limit.max_requests must be an integer in",
        ),
        (
            {"digs_scheduler_config": {"deploy_mode": "both"}},
            'deploy_mode must be one of pd_separate, single_node, got "both"',
        ),
        (
            {"backend_config": {"maxIterTimes": True}},
            "backend_config.maxIterTimes must be an integer",
        ),
        ({"tls_config": {"request_server_tls_enable": True}}, "needs tls_config.tls_cert"),
    ],
)
def test_bad_values_name_the_key_range_and_value(tmp_path, config, message):
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, config))
    assert message in str(error.value)


def test_unknown_keys_are_ignored_with_a_warning(tmp_path, caplog):
    config = load_config(
        _write(tmp_path, {"http_config": {"predict_port": 2000, "nope": 1}, "mystery": {}})
    )
    assert config["http_config"]["predict_port"] == 2000
    assert "http_config.nope" in caplog.text and "mystery" in caplog.text


@pytest.mark.parametrize(
    "contents, message",
    [
        (
            '{"http_config": {"predict_port": 99999}}',
            "http_config.predict_port must be an integer in [1024, 65535], got 99999",
        ),
        ("{not json", "is not valid JSON"),
    ],
)
def test_broken_config_file_is_one_line_and_exit_code_2(tmp_path, contents, message):
    path = tmp_path / "ms_coordinator.json"
    path.write_text(contents)
    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_cli_values_are_validated_too():
    with pytest.raises(ConfigError, match="http_config.predict_port must be an integer in"):
        resolve_config(parse_args(["--predict-port", "70000"]))


def _help_text(capsys) -> str:
    with pytest.raises(SystemExit) as done:
        parse_args(["--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps help text


def test_help_gives_every_option_its_help_default_and_config_key(capsys):
    text = _help_text(capsys)
    assert "`" not in text  # plain text, no reST markup
    for action in build_parser()._actions:
        assert action.help, f"{action.dest} has no help"
        if action.dest in OVERRIDES:
            key = OVERRIDES[action.dest]
            section, name = key.split(".")
            help_text = " ".join(action.help.split())
            assert help_text in text
            assert f"config key {key})" in help_text
            assert "(default: " in help_text
            if SCHEMA[section][name].default not in ("", {}):
                assert f"(default: {SCHEMA[section][name].default};" in help_text
    assert "--config PATH" in text and f"${CONFIG_PATH_ENV}" in text
    assert "PREDICT_IP [PREDICT_PORT [MANAGE_IP [MANAGE_PORT]]]" in text


def test_help_lists_every_override():
    flags = {a.dest for a in build_parser()._actions if a.option_strings}
    assert set(OVERRIDES) <= flags


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as done:
        parse_args(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"pdserve {metadata.version('pdserve')}\n"


def test_integer_ranges_are_printed_as_integers(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, {"backend_config": {"maxIterTimes": 0}}))
    assert str(error.value) == (
        "backend_config.maxIterTimes must be an integer in [1, 4194304], got 0"
    )


@pytest.mark.parametrize(
    "dotted",
    [
        f"{section}.{name}"
        for section, keys in SCHEMA.items()
        for name, key in keys.items()
        if key.kind in ("int", "port")
    ],
)
def test_every_integer_key_names_its_range_in_integers(dotted):
    section, name = dotted.split(".")
    with pytest.raises(ConfigError) as error:
        SCHEMA[section][name].parse(dotted, -1)
    assert re.fullmatch(
        rf"{re.escape(dotted)} must be an integer in \[\d+, \d+\], got -1", str(error.value)
    )
