"""The job's spec: reading DistBeliefJob manifests (manifests.py), walking the CRD's
structural schema to check values and apply its defaults (schemawalk.py), and validating
a job with the rules a schema cannot say, into the config the roles read (spec.py).

The bottom of the operator, shared by the cluster operator, local mode and the CLI; it may
use only the runtime's contract and errors.
"""
