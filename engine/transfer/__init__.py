"""KV hand-off transports behind one small interface, chosen by name (``transports.py``).

``zmq`` (default): on one host the pages go through a ``/dev/shm`` file of the sender's and the
socket carries only the header (``shared_memory.py``); otherwise, or with ``shared_memory=False``,
one multipart message per request: a header frame and one page frame sent zero-copy from the
exported buffer, received into a reused buffer. ``grpc``: client streaming of 4 MiB chunks.
``inprocess``: a direct call, for unit tests of engines in one process.

With :class:`KVCredentials` (``security.py``) ZMQ runs CURVE and gRPC runs TLS, both with peer
authentication: a receiver admits only the cluster's senders, a sender talks only to the
cluster's receivers.

A receiver serves its transfers within ``stream_timeout_s`` each (gRPC cuts longer pushes; a ZMQ
message is whole or absent) and tells ``on_broken`` about transfers that broke after their
header. A sender keeps one connection per endpoint in use, closed when a transfer over it breaks
or when it stays unused (``endpoints.py``).

Senders and receivers count the payloads installed by the path their pages took
(``payloads_by_path``: ``shared_memory``, ``frames``, ``chunks`` or ``direct``).
"""
