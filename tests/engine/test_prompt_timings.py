"""Where a prompt's time to first token went on its engine: the first token's event says how
long the request waited before its prompt's first chunk ran (``queued_s``) and how long from
then to that token (``prefill_s``); later events, and a request whose pages were imported, say
nothing."""

from __future__ import annotations

import time

from engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.support.kv_import import import_kv


def _run(engine) -> dict[str, list]:
    events: dict[str, list] = {}
    while engine.has_work():
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    return events


def test_the_first_token_says_how_long_its_prompt_queued_and_computed(tiny_loaded):
    # a 16-token step budget: the second prompt waits for the first's two chunks to run
    engine = make_engine(tiny_loaded, max_prefill_tokens=16)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    start = time.monotonic()
    engine.add_request(engine.request("first", list(range(10, 42)), params))
    engine.add_request(engine.request("second", list(range(50, 58)), params))
    events = _run(engine)
    first, second = events["first"], events["second"]
    for stream in (first, second):
        assert stream[0].queued_s is not None and stream[0].prefill_s is not None
        assert stream[0].queued_s >= 0 and stream[0].prefill_s > 0
        assert all(e.queued_s is None and e.prefill_s is None for e in stream[1:])
        assert stream[0].queued_s + stream[0].prefill_s <= stream[0].emitted_at - start + 1e-6
    # the first computed over two steps (32 tokens in chunks of 16), the second queued meanwhile
    assert first[0].queued_s < second[0].queued_s
    assert second[0].queued_s >= first[0].prefill_s - 1e-3  # both of the first's steps


def test_a_one_token_prompt_computed_as_a_decode_is_timed_too(tiny_loaded):
    engine = make_engine(tiny_loaded)
    engine.add_request(
        engine.request("one", [3], SamplingParams(max_new_tokens=2, ignore_eos=True))
    )
    first, second = _run(engine)["one"]
    assert first.queued_s is not None and first.prefill_s > 0 and second.queued_s is None


def test_an_imported_request_reports_no_prompt_timing(tiny_loaded):
    prefill, decode = make_engine(tiny_loaded), make_engine(tiny_loaded)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prefill.add_request(prefill.request("r", list(range(10, 30)), params, prefill_only=True))
    (first,) = _run(prefill)["r"]
    assert first.queued_s is not None  # the prefill engine computed the prompt
    payload = prefill.export_kv("r", 4)
    import_kv(decode, payload)
    events = _run(decode)["r"]
    assert events and all(e.queued_s is None and e.prefill_s is None for e in events)
