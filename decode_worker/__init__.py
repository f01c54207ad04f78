"""Decode workers: Ray actors that receive KV blocks and decode in continuous batches."""
