"""The elastic worker: a prefill or a decode worker by turns (``worker.py``)."""
