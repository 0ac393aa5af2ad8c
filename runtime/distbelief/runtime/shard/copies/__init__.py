"""A shard's copies (spec.parameterServers.backups): chain replication from the primary to
its backups (replication.py), and each copy's watch on the others' state (watch.py).

Attached to the shard core from above (Shard.serve_copies) through the small interface the
core defines (plugin.Replication); it may use the core, the transport and the wire.
"""
