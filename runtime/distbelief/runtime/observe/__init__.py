"""What a role shows of itself: Prometheus metrics, the small HTTP server that serves them
with the health probes, and the count of the process's transport traffic.

A bottom layer that the transport (traffic) and the shard, the replicas and the chief
(metrics) all use; it may use only the runtime's top-level modules (contract).
"""
