"""The renderer: pure functions from a validated job to the Kubernetes objects that run it
(render.py), the parts every pod shares (podparts.py), what every render function knows
of the job (context.py), and the memory check of a job's pods (sizing.py).

One renderer for the cluster operator, `distbelief render` and local mode; it may use spec
and, from the runtime, only the contract and the keys.
"""
