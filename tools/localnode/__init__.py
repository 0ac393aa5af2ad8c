"""local-node: a node agent that runs the pods bound to its Node as processes of this machine.

It plays the kubelet for the project's tests and for a whole stack on one machine (a
control plane, the operator, `kubectl apply`): it registers a Node and keeps its Lease
fresh (registration), runs each bound pod's containers with local mode's pod runner
(pods, containers, volumes; localpods.LocalPod), probes them (probes), writes their
status as a kubelet does (podstatus), gives every pod an IP of its own on loopback and
maps the cluster's DNS names to them (addresses, roles), provisions folders for volume
claims (provisioner), and serves logs and pods by name over HTTP(S) (endpoint, logs).
Not a product role, so not in the wheel: `tools/local-node --kubeconfig FILE [--name NAME]`
runs it with the installed distbelief, from this folder.
"""
