"""`kubectl distbelief` (the `kubectl-distbelief` command): a job's state, pods, logs and
figures in a few words, from a cluster or from a local run's output folder.

command.py parses the command line and reports errors; clusterjobs.py reads and changes
jobs through the Kubernetes API with the user's kubeconfig; localjobs.py reads a local
run's folder (local/livestatus.py); pods.py picks a job's pods; views.py and top.py turn
what was read into text, as pure functions.

The top layer of the operator's half, beside cli and node: it may use cluster's API calls,
local's folder, status's progress and metrics parsing, and the runtime's contract. It never
imports kopf (an import-linter contract).
"""
