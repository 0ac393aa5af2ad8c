"""One parameter shard's core, and what may be attached to it.

The core (core.py) serves requests one at a time: it checks each against its op's spec,
the shard and the layout, answers a resent command with its first reply (resends.py),
answers DONE once the job is finished, and writes atomic checkpoints on a schedule
(saves.py, checkpoint.py). What a shard holds and which ops it answers come from the
plugins an algorithm attaches (plugin.ShardPlugin); with backups, a copies/ object the
role hands it (plugin.Replication). It knows no algorithm and no parameter kind; it may
use transport, wire, observe and the runtime's top-level modules.
"""
