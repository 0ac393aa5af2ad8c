"""The operator half: a DistBeliefJob turned into Kubernetes objects, on a cluster (kopf)
or as local processes, and the `distbelief` command.

Layers, top to bottom; a folder may import only what lies below it, and folders on one
line do not import each other (pyproject.toml's import-linter contracts check this):

    cli.py               the `distbelief` command
    predict.py           predictions from a finished local run's parameters
    local/ | cluster/    local mode | the operator on a cluster (independent)
    render/ | status/    the one renderer | the status from what was observed
    spec/                reading and validating the job
    errors.py            the operator's error tree (SpecError, KubeError, ScrapeError)

docs/architecture.md draws the whole project.
"""
