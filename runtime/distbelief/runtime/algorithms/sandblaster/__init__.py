"""Sandblaster L-BFGS: batch optimisation driven by a coordinator that holds no vector.

    shards       hold the parameters x and, on their slices, every other vector of the
                 method: the gradient g, the search direction d, the trial point xt and
                 its gradient gt, and the history pairs s_i, y_i (vectors.Slots).
    coordinator  runs beside shard 0 (like the chief). It drives L-BFGS with small
                 commands (dot, axpy, scale, copy of named vectors) that every shard runs
                 on its slice, and sees only the scalars they return (lbfgs.Lbfgs).
    replicas     ask the coordinator for work units (a few dozen examples of the batch),
                 pull the trial point once per evaluation, and add each unit's gradient
                 to gt on the shards (replica.Replica). The last units are handed out
                 again to idle replicas as backup tasks; the first result wins and the
                 shards drop the duplicate (workqueue.WorkQueue).

Each accepted iteration is committed: every shard checkpoints its vectors with the
coordinator's scalar state. A restarted shard or coordinator rolls every shard back to
the newest iteration they all hold and carries on from there.
"""
