"""A shard's copies (spec.parameterServers.backups): a primary and its backups, whose view
changes only by compare-and-swap on a linearizable store.

    replication.py   the copy's roles and decisions (plugin.Replication for the core)
    forwarding.py    the primary's streams to the other copies, their acknowledgements
    following.py     a copy's side of its primary's stream: JOIN, the transfer, the forwards
    transfer.py      the state sent in parts while the primary serves
    keeper.py        the lease, renewed and the in-sync set written from a thread of its own
    watch.py         the other copies' COPY_STATUS, asked from another thread
    viewstore.py     the record and its stores: a flock'd file, in memory
    kubelease.py     ... a coordination.k8s.io Lease (kubeapi.py: a stdlib API client)
    stores.py        which store, from the pod's environment
    epoch.py         the highest view a copy was in, beside its checkpoints: views never reused

Attached to the shard core from above (Shard.serve_copies) through the small interface the
core defines (plugin.Replication); it may use the core, the transport and the wire.
"""
