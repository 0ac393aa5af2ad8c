"""The numbers a replica computes with: models (models.py: the MLP, softmax regression and
user code's models), embeddings over id fields (embedding.py), data sets (data.py:
built-in, synthetic and npz sources, the held-out split, minibatches), a model's cut into
stages (stages.py), and the one derivation of all of these from a job's config (job.py:
data, model, cut, layout; what every role, local mode's checks and predict use).

Plain numpy: it may use the wire's row-key hash and Layout and the runtime's top-level
modules (contract, jobspec, errors), never the transport, the shards, their clients or the
parameter kinds.
"""
