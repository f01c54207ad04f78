"""pdserve's engine: model loading, paged KV cache, continuous-batching scheduler, sampler.

Prefill workers, decode workers and the colocated mode all run :class:`engine.llm_engine.LLMEngine`.
"""
