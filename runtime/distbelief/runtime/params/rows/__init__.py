"""Embedding rows, a parameter kind of jobs with spec.model.embeddings.

The row table (rowtable.py: open addressing, row-wise Adagrad, admission, expiry), its
base and delta checkpoints (rowcheckpoint.py), the shard plugin with SPARSE_PULL and
SPARSE_PUSH (sparse.py), and the replica's side (row_client.py). Which shard owns a row is
the wire's (rowkeys.owner_of).
"""
