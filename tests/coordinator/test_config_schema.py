"""The configuration schema: environment variables between the file and the CLI, one naming
rule, and defaults that are the dataclasses' own (each written once)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from coordinator.cli import parse_args, resolve_config
from coordinator.config.cluster import DEPLOY_MODES, ClusterConfig
from coordinator.config.keys import Feed, fed
from coordinator.config.loader import defaults, load_config
from coordinator.config.schema import KEYS, SCHEMA, STEP_TARGET_MS
from coordinator.inference import Timeouts
from coordinator.routing.config import RoutingConfig
from coordinator.served_model import ServedModels, cluster_config, routing_config
from engine.config import KVTransferConfig
from engine.errors import ConfigError

# MindIE's own names (MindIE-MS's ms_coordinator.json, MindIE Server's config.json)
MINDIE_CAMEL_CASE = {
    "maxSeqLen",
    "maxInputTokenLen",
    "maxIterTimes",
    "maxBatchSize",
    "maxPrefillTokens",
    "maxPrefillBatchSize",
    "cacheBlockSize",
    "fullTextEnabled",
    "enablePrefixCaching",
}
OLDER_CAMEL_CASE = {"kvCacheMemoryMB", "stepTargetMs"}  # pdserve's, from before the rule


def _write(tmp_path, config) -> str:
    path = tmp_path / "ms_coordinator.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_environment_wins_over_the_file_and_the_cli_over_both(tmp_path, monkeypatch):
    path = _write(
        tmp_path,
        {
            "http_config": {"predict_port": 2000, "manage_port": 2001},
            "backend_config": {"maxIterTimes": 64, "maxSeqLen": 1000},
        },
    )
    monkeypatch.setenv("PDSERVE_HTTP_CONFIG__PREDICT_PORT", "2500")
    monkeypatch.setenv("PDSERVE_BACKEND_CONFIG__MAXSEQLEN", "4096")
    monkeypatch.setenv("PDSERVE_BACKEND_CONFIG__KV_SHARED_MEMORY", "false")
    monkeypatch.setenv("PDSERVE_HTTP_CONFIG__API_KEYS", "k1, k2")
    monkeypatch.setenv("PDSERVE_BACKEND_CONFIG__PREFILL_RESOURCES", '{"num_cpus": 2}')
    config = load_config(path)
    assert config["http_config"]["predict_port"] == 2500  # the environment over the file
    assert config["http_config"]["manage_port"] == 2001  # the file where no variable is set
    assert config["backend_config"]["maxIterTimes"] == 64
    assert config["backend_config"]["maxSeqLen"] == 4096
    assert config["backend_config"]["kv_shared_memory"] is False
    assert config["http_config"]["api_keys"] == ("k1", "k2")
    cluster = cluster_config(config, ServedModels(None, None))
    assert cluster.prefill_resources.num_cpus == 2.0 and not cluster.kv.shared_memory
    config = resolve_config(parse_args(["--config", path, "--predict-port", "3000"]))
    assert config["http_config"]["predict_port"] == 3000  # the CLI over the environment


def test_environment_alone_over_the_defaults(monkeypatch):
    monkeypatch.setenv("PDSERVE_DIGS_SCHEDULER_CONFIG__DEPLOY_MODE", "single_node")
    monkeypatch.setenv("PDSERVE_HTTP_CONFIG__MANAGE_API_KEYS", '["m-1"]')
    config = resolve_config(parse_args([]))
    assert config["digs_scheduler_config"]["deploy_mode"] == "single_node"
    assert config["http_config"]["manage_api_keys"] == ("m-1",)
    cluster = cluster_config(config, ServedModels(None, None))
    assert cluster.engine.scheduler.step_target_ms == STEP_TARGET_MS["single_node"]


@pytest.mark.parametrize(
    "variable, text, message",
    [
        (
            "PDSERVE_BACKEND_CONFIG__MAXITERTIMES",
            "0",
            "backend_config.maxIterTimes must be an integer in [1, 4194304], got 0",
        ),
        (
            "PDSERVE_BACKEND_CONFIG__MAXITERTIMES",
            "many",
            'backend_config.maxIterTimes must be an integer in [1, 4194304], got "many"',
        ),
        (
            "PDSERVE_HTTP_CONFIG__PREDICT_PORT",
            "80",
            "http_config.predict_port must be an integer in [1024, 65535], got 80",
        ),
        (
            "PDSERVE_BACKEND_CONFIG__KV_SHARED_MEMORY",
            "maybe",
            'backend_config.kv_shared_memory must be true or false, got "maybe"',
        ),
        (
            "PDSERVE_BACKEND_CONFIG__KV_TRANSPORT",
            "carrier-pigeon",
            'backend_config.kv_transport must be one of zmq, grpc, got "carrier-pigeon"',
        ),
        (
            "PDSERVE_BACKEND_CONFIG__DECODE_RESOURCES",
            '{"gpus": 1}',
            "backend_config.decode_resources must be",
        ),
    ],
)
def test_environment_values_are_checked_like_the_files(monkeypatch, variable, text, message):
    monkeypatch.setenv(variable, text)
    with pytest.raises(ConfigError) as error:
        load_config()
    assert message in str(error.value)


def test_unknown_environment_keys_are_ignored_with_a_warning(caplog):
    environ = {"PDSERVE_BACKEND_CONFIG__NOPE": "1", "PDSERVE_CACHE_DIR": "/tmp/x"}
    config = load_config(environ=environ)
    assert config.values == defaults().values
    assert "PDSERVE_BACKEND_CONFIG__NOPE" in caplog.text
    assert "PDSERVE_CACHE_DIR" not in caplog.text  # not a key's variable: no double underscore


def test_every_key_has_its_own_environment_variable():
    names = [key.env_name for key in KEYS]
    assert len(set(names)) == len(names) == 108
    assert all(re.fullmatch(r"PDSERVE_[A-Z_]+__[A-Z0-9_]+", name) for name in names)


def test_keys_of_pdserve_are_snake_case_and_mindies_keep_their_names():
    for key in KEYS:
        if key.name not in MINDIE_CAMEL_CASE | OLDER_CAMEL_CASE:
            assert re.fullmatch(r"[a-z][a-z0-9_]*", key.name), key.dotted


def test_every_key_has_one_line_of_doc():
    for key in KEYS:
        assert key.doc and "\n" not in key.doc and key.section in SCHEMA, key.dotted


def test_the_files_defaults_are_the_dataclasses_own():
    """Left out of the file, a key gives its field the field's own default (the exceptions: the
    deploy mode's stepTargetMs, schedule_timeout's hand-off wait, and what is served)."""
    config = defaults()
    cluster = cluster_config(config, ServedModels(None, ClusterConfig.embedding_model_path))
    base = ClusterConfig()
    scheduler = replace(base.engine.scheduler, step_target_ms=STEP_TARGET_MS["pd_separate"])
    assert cluster == replace(
        base,
        engine=replace(base.engine, scheduler=scheduler),
        reservation_wait_s=float(config["exception_config"]["schedule_timeout"]),
        generation=False,
    )
    assert routing_config(config, cluster.engine) == RoutingConfig()
    assert Timeouts(**config.fed(Timeouts)) == Timeouts()


def test_fed_keys_take_the_fields_range():
    maxseqlen = SCHEMA["backend_config"]["maxSeqLen"]
    assert (maxseqlen.low, maxseqlen.high) == (2, 1 << 22)
    with pytest.raises(ConfigError, match="maxSeqLen must be an integer in \\[2, 4194304\\]"):
        replace(ClusterConfig().engine.scheduler, max_seq_len=1)


def test_a_key_takes_its_fields_choices_and_may_only_narrow_them():
    assert SCHEMA["digs_scheduler_config"]["deploy_mode"].choices == DEPLOY_MODES
    assert SCHEMA["backend_config"]["kv_transport"].choices == ("zmq", "grpc")  # no "inprocess"
    with pytest.raises(ValueError, match="among the field's own"):
        fed("x", "str", Feed(KVTransferConfig, "transport"), "", choices=("zmq", "pigeon"))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("encryption", "maybe", "kv_encryption must be one of auto, on, off; got 'maybe'"),
        ("transport", "pigeon", "kv_transport must be one of zmq, grpc, inprocess; got 'pigeon'"),
        ("shared_memory", "no", "kv_shared_memory must be true or false, got 'no'"),
    ],
)
def test_the_kv_settings_refuse_what_their_fields_do_not_allow(field, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        KVTransferConfig(**{field: value})


SECRET = "sk-live-0123456789abcdef"


@pytest.mark.parametrize(
    ("value", "received"),
    [
        (SECRET, "a string of length 24"),
        ([SECRET, 7], "a list of length 2 holding number, string"),
        ({"key": SECRET}, "an object of length 1"),
    ],
)
@pytest.mark.parametrize("key", ["api_keys", "manage_api_keys"])
def test_a_mistyped_key_list_is_named_by_its_type_never_its_value(tmp_path, key, value, received):
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, {"http_config": {key: value}}))
    assert str(error.value) == f"http_config.{key} must be a list of strings, got {received}"
    assert "sk-live" not in str(error.value)


def test_a_key_list_from_the_environment_is_not_echoed_either():
    variable = "PDSERVE_HTTP_CONFIG__API_KEYS"
    with pytest.raises(ConfigError) as error:
        load_config(environ={variable: f'["{SECRET}"'})  # a JSON list cut short
    assert str(error.value) == (
        "http_config.api_keys must be a list of strings, got a string of length 27"
    )


def test_a_section_that_is_not_an_object_is_named_by_its_type(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, {"http_config": [SECRET]}))
    assert (
        str(error.value)
        == "http_config must be a JSON object, got a list of length 1 holding string"
    )


def test_other_keys_still_show_the_value_received(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, {"http_config": {"predict_ip": "nowhere"}}))
    assert str(error.value).endswith('got "nowhere"')
