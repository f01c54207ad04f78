"""The configuration of each client's limits: ``http_config.api_key_priority`` names keys of
``api_keys`` with priorities in [1, 5] (else start-up stops, without echoing a key), and the
coordinator's predict app takes every limit from its configuration."""

from __future__ import annotations

import json

import pytest

from coordinator.config.loader import load_config
from coordinator.door_limits import door_limits
from coordinator.server import Coordinator
from engine.errors import ConfigError
from tests.support.coordinator_configs import config_with


def config_file(tmp_path, **http: object) -> str:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"http_config": {"api_keys": ["k1", "k2"], **http}}))
    return str(path)


@pytest.mark.parametrize(
    ("priorities", "message"),
    [
        ({"k3": 1}, r"\(entry 1\) names a key that is not in http_config\.api_keys"),
        ({"k1": 2, "k2": 0}, r"\(entry 2\) must be an integer in \[1, 5\], got 0"),
        ({"k1": "1"}, r"\(entry 1\) must be an integer in \[1, 5\], got \"1\""),
        ({"k1": True}, r"must be an integer in \[1, 5\], got true"),
    ],
)
def test_a_bad_priority_entry_stops_start_up(tmp_path, priorities, message):
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(config_file(tmp_path, api_key_priority=priorities), environ={})
    assert "k3" not in str(refused.value)


def test_the_door_limits_come_from_the_configuration(tmp_path):
    path = tmp_path / "c.json"
    limits = {"max_buffered_body_mb": 64, "max_requests_per_key": 3, "tokens_per_minute_per_key": 9}
    limits["grammar_compiles_per_minute_per_key"] = 5
    http = {"api_keys": ["k1"], "api_key_priority": {"k1": 2}}
    path.write_text(json.dumps({"http_config": http, "request_limit": limits}))
    door = door_limits(load_config(str(path), environ={}))
    assert (door.max_buffered_body_mb, door.max_requests_per_key) == (64, 3)
    assert door.tokens_per_minute_per_key == 9 and door.grammar_compiles_per_minute_per_key == 5
    assert door.priority_by_key == {"k1": 2}


def test_the_coordinators_predict_app_takes_its_limits_from_the_configuration():
    config = config_with(api_keys=["k1"], api_key_priority={"k1": 2}).with_overrides(
        {
            "request_limit.max_buffered_body_mb": 32,
            "request_limit.max_requests_per_key": 4,
            "request_limit.tokens_per_minute_per_key": 600,
            "request_limit.grammar_compiles_per_minute_per_key": 30,
        }
    )
    app = Coordinator(config).predict_app()
    assert app.state.body_budget.limit_bytes == 32 * 1024 * 1024
    assert app.state.client_limits.max_requests_per_key == 4
    assert app.state.client_limits.tokens.capacity == 600
    assert app.state.client_limits.compiles.capacity == 30
