"""Downpour SGD (Dean et al., 2012): replicas pull the parameters every fetchEvery steps and
push their accumulated gradients every pushEvery steps, each shard applying them as they
come.

    algorithm.py      its hooks: the shards' plugins, the replicas' loop, the held-out set
    updates.py        what it adds to each shard's core: warm-start admission, staleness,
                      the replicas' mean loss and count
    worker.py         a replica's loop
    sparse_worker.py  a replica of a model with embeddings: only the rows a minibatch touches
"""
