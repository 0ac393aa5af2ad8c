"""Every socket of the runtime: the one layer that imports ZeroMQ.

The transport interface (Server, Link, Transport; interface.py) with two makers of it:
ZeroMQ for the roles (zmq_transport.py, with zmq_server.py and zmq_link.py) and an
in-process twin for unit tests (memory_transport.py). exchange() sends one request to
several links under a RetryPolicy (fanout.py); a link to a shard with backups moves
between its copies' addresses (copy_addresses.py); servers admit the job's keys through
ZAP (admission.py) and encrypted jobs' parameters go in AES-GCM sessions (sessions.py)
over TCP connections of our own framing (framing.py) to a server's bulk port (bulk_port.py).
It knows nothing of ops or shards; it may use observe (traffic) and the runtime's
top-level modules (errors, keys).
"""
