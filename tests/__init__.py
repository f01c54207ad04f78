"""pdserve's tests. Nothing in them may reach a model hub: set before any test module (or
the conftest's imports) loads ``huggingface_hub``, which reads it once, at import."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
