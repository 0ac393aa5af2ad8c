"""The replica's view of a job's shards (and the chief's, and the coordinator's).

A ShardGroup (group.py) sends one request to every shard of the job at once, or to a
consecutive run of them, and reads the replies: timeouts and resends under one
RetryPolicy, error replies turned into errors by their code, a shard's copies tried in
turn. It is generic: what an op means (dense slices, sparse rows, Sandblaster's vectors)
is the parameter kinds' and the algorithms'. It may use transport, wire and the runtime's
top-level modules.
"""
