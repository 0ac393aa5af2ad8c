"""The operator on a cluster: the kopf handlers that reconcile a DistBeliefJob's children and
keep its status (handlers.py), what a status pass reads from the operator's watches
(observing.py), its few Kubernetes API calls (kube.py), the watch on kopf's peering object
(peering.py), and the operator's own Prometheus metrics (metrics.py).

The only part that imports kopf and the kubernetes client. It may use render, status and
spec, and from the runtime only the contract, the keys, the key files and the errors (an
import-linter contract in pyproject.toml): the operator process needs none of the roles.
"""
