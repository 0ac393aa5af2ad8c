"""The runtime half: what runs in the pods, parameter shards and model replicas (numpy and
pyzmq; never kopf, the Kubernetes client or the operator).

Layers, top to bottom; a folder may import only what lies below it, and folders on one
line do not import each other (pyproject.toml's import-linter contracts check this):

    roles/                      `distbelief ps`, `distbelief worker`
    algorithms/                 Downpour, Sandblaster, partitioned replicas; the chief
    params/ | model/            parameter kinds (shard plugins + their client calls) | numpy models, data,
                                the job's one derivation (model/job.py: data, model, cut, layout)
    shard/ | client/            the shard core and its copies | the replica's view of the shards
    transport/                  every socket (the only ZeroMQ user)
    wire/ | observe/            protocol, codecs, layout | metrics, their HTTP server, traffic
    keys, keyfiles, contract, errors   beside the layers: what the operator imports too
    jobspec                     the typed, frozen job; the only reader of the CRD's keys

docs/architecture.md draws the whole project.
"""
