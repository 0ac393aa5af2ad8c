"""The training data partitioned over the replicas, as the parameters are over the shards.

A job whose spec.data.source is a set of files (model/files.py) is read in work units: a
Parquet row group, or a file. Beside shard 0 the chief's Dispenser (dispenser.py) hands
the units out on the coordinator port (ops.py: NEXT_UNIT); each replica streams only the
units it was handed (stream.py; with a model's embeddings, the examples' ids too),
through a shuffle buffer that a thread keeps filled, and reports each unit finished once
every example of it has gone into a minibatch. Every
unit is handed out once per epoch; units.py says what happens to a replica's units when
the replica leaves or dies. The dispenser counts the epochs (status, report.json,
history.jsonl: `epoch`).
"""
