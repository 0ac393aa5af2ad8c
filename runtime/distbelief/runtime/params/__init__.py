"""The kinds of parameters a shard holds, each as a shard plugin with its ops and the
replica's calls that send them.

Dense slices of the flat parameter vector (dense.py) with their optimizers (optim.py, their
loops compiled in kernels.py) and their pull/push from a replica (dense_client.py, float32
or bfloat16 on the wire); embedding rows in hash tables (rows/). They may use shard, client, transport, wire, observe
and the runtime's top-level modules; never a model or an algorithm.
"""
