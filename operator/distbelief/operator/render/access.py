"""With backups: the ServiceAccount, Role and RoleBinding <job>-ps that let the shard copies
keep their view in Leases <job>-shard-<i>.
"""

from __future__ import annotations

from distbelief.operator.render import podparts
from distbelief.operator.render.context import RenderContext
from distbelief.runtime import contract


RBAC_API = "rbac.authorization.k8s.io"


def render_ps_access(ctx: RenderContext) -> list[podparts.Manifest]:
    """With backups: the shard pods' ServiceAccount, and the Role and RoleBinding that let it
    keep each shard's view in a Lease (runtime shard/copies/kubelease.py): get and update the
    job's Leases by name, and create (which no name can restrict). Nothing without backups:
    the pods then get no token at all."""
    account = podparts.copies_account(ctx)
    if account is None:
        return []
    leases = [ctx.names.shard_lease(i) for i in range(ctx.spec.parameter_servers.shards)]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": podparts.metadata(ctx, account, contract.ROLE_PS),
         "automountServiceAccountToken": False},  # only the pods that ask for it (the shards) mount it
        {"apiVersion": f"{RBAC_API}/v1", "kind": "Role",
         "metadata": podparts.metadata(ctx, account, contract.ROLE_PS),
         "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
                   {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": leases,
                    "verbs": ["get", "update"]}]},
        {"apiVersion": f"{RBAC_API}/v1", "kind": "RoleBinding",
         "metadata": podparts.metadata(ctx, account, contract.ROLE_PS),
         "roleRef": {"apiGroup": RBAC_API, "kind": "Role", "name": account},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ctx.config.namespace}]},
    ]
