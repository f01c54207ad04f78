"""A request's ``priority`` is an entitlement of its key (``http_config.api_key_priority``): 1 is
served first, so a request asking a smaller number than its key's is served at its key's; a
larger one is kept; unlisted keys get 5 once any key is listed; with none listed, any priority
is served as asked. MindIE's is the door that takes a priority (``parameters.priority``)."""

from __future__ import annotations

from coordinator.door_limits import DoorLimits
from tests.support.door_fakes import ScriptedService, post, predict_app

KEY_A, KEY_B = "key-a-secret", "key-b-secret"


def served_priority(asked: int, key: str, priorities: dict[str, int]) -> int:
    service = ScriptedService(1)
    limits = DoorLimits(priority_by_key=priorities)
    app = predict_app(service, door_limits=limits, api_keys=(KEY_A, KEY_B))
    body = {"inputs": "hi", "parameters": {"priority": asked}}
    response = post(app, "/infer", body, headers={"api-key": key})
    assert response.status_code == 200, response.text
    (request,) = service.requests
    return request.priority


def test_a_better_priority_than_the_keys_is_clamped_to_it():
    assert served_priority(1, KEY_A, {KEY_A: 3}) == 3
    assert served_priority(3, KEY_A, {KEY_A: 3}) == 3
    assert served_priority(4, KEY_A, {KEY_A: 3}) == 4


def test_a_key_not_listed_is_served_at_5_once_any_key_is():
    assert served_priority(1, KEY_B, {KEY_A: 1}) == 5
    assert served_priority(1, KEY_A, {KEY_A: 1}) == 1


def test_with_no_key_listed_any_priority_is_served_as_asked():
    assert served_priority(1, KEY_B, {}) == 1
