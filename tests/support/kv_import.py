"""A whole KV hand-off into a decode engine in one call, for engine tests that move pages between
two engines of one process (workers go through the transport and the importer's steps instead)."""

from __future__ import annotations

from engine.errors import KVImportError
from engine.llm_engine import LLMEngine
from engine.request import NewRequest, RequestStatus
from engine.transfer.payload import KVPayload


def import_kv(engine: LLMEngine, payload: KVPayload, max_output_tokens: int | None = None) -> None:
    """Install received pages into a request that continues decoding: into its reservation
    (decoding to the reservation's output limit), or into blocks reserved now (decoding to
    ``max_output_tokens``, by default the limit the pages carry). On a mismatch the
    reservation ends with the error, which is raised too (pages are never decoded into
    garbage)."""
    importer, state = engine.importer, payload.state
    if state.request_id not in engine.requests:
        new = NewRequest(
            state.request_id,
            tuple(state.prompt_token_ids),
            state.params,
            max_output_tokens or state.max_output_tokens,
            output_token_ids=tuple(state.token_ids[state.num_prompt_tokens :]),
            priority=state.priority,
        )
        # fewer shared blocks than the pages skip: the pages do not fit, refused
        reserved = importer.reserve_import(
            new, token=payload.token, max_shared_blocks=state.first_block
        )
        if reserved is None:
            raise KVImportError(f"no free KV blocks for request {state.request_id!r}")
    try:
        request = importer.take_reservation(payload)
    except KVImportError as exc:
        if engine.requests[state.request_id].status == RequestStatus.RESERVED:
            engine.abort(state.request_id, str(exc))
        raise
    error = importer.write_pages(request, payload)
    importer.finish_receive(request, state, error)
    if error is not None:
        raise KVImportError(error)
