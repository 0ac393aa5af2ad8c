"""Model-parallel replicas (spec.model.partitions > 1): one replica spread over N pods, one
per stage of the model's cut (model/stages.py: the cut and what a stage computes).

    ops.py        the ops: stage to stage, replica to rendezvous, replica to shard
    staged.py     the shards' side: gradients held until their step is committed
    commit.py     partition 0's side: a step applied on every shard or on none
    rendezvous.py beside shard 0: forms replica groups, one pod of each partition
    neighbour.py  a stage's FORWARD to the next one, and the checks of one received
    replica.py    a partition pod's loop; partition 0's
    later.py      partition k > 0's: FORWARDs answered, pulls started by PREFETCH
    evaluation.py the chief's scorer of a partitioned model, one stage at a time
    algorithm.py  the hooks registry.py gives a partitioned Downpour job
"""
