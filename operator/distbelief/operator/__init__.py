"""The operator half: a DistBeliefJob turned into Kubernetes objects, on a cluster (kopf)
or as local processes, and the `distbelief` command.

Layers, top to bottom:

    cli.py, predict.py   the command, and predictions from a finished local run
    local/ | cluster/    local mode | the operator on a cluster (independent)
    render/ | status/    the one renderer | the status from what was observed
    spec/                reading and validating the job

docs/architecture.md draws the whole project.
"""
