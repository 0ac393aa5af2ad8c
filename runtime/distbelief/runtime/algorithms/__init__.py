"""The training algorithms: what each puts on the shards, beside the chief, and in the
replicas, as hooks the roles call (interface.py), listed by name in registry.py.

    downpour/     Downpour SGD: asynchronous pushes and pulls, warm-start, staleness
    sandblaster/  Sandblaster L-BFGS: a coordinator, work units, vectors on the shards
    pipeline/     a Downpour replica partitioned over several pods, one stage each
    chief.py      beside shard 0 for every algorithm: scores the model, ends the job

The algorithms are independent of each other (registry.py composes Downpour with the
pipeline); they may use params, model, shard, client, transport, wire, observe and the
runtime's top-level modules.
"""
