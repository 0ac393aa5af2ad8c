"""The entry points of the containers: `distbelief ps` (ps.py) and `distbelief worker`
(worker.py), and what both set up in the same way (common.py: keys, the shards' client,
metrics, the stop signal). What both derive from the job's config is model/job.py's.
`distbelief reshard-claims` (reshard.py) re-lays a job's checkpoints for another shard count.

The top of the runtime: a role picks the job's algorithm from the registry and wires the
shard core, its copies, the chief and the replica loop together. It may use every layer
below it.
"""
