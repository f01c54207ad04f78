"""Prefill workers: Ray actors that compute prompts and the first token, then hand off the KV."""
