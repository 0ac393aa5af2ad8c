"""The numbers a replica computes with: models (models.py: the MLP, softmax regression and
user code's models), embeddings over id fields (embedding.py), and data sets (data.py:
built-in, synthetic and npz sources, the held-out split, minibatches).

Plain numpy: it may use the wire's row-key hash and the runtime's top-level modules
(contract, errors), never the transport, the shards, their clients or the parameter kinds.
"""
