"""Which view store a shard's copies use (viewstore.py), as the pod's environment says.

    DISTBELIEF_VIEW_STORE=file:FOLDER   FileViewStore FOLDER/shard-<i>.json (local mode sets it)
    DISTBELIEF_VIEW_STORE=kubernetes    a Lease per shard (kubelease.py), with the pod's own
                                        ServiceAccount (its token in
                                        $DISTBELIEF_SERVICE_ACCOUNT_DIR, else where Kubernetes
                                        mounts it); also what an unset variable means in
                                        a cluster (KUBERNETES_SERVICE_HOST set)
"""

from __future__ import annotations

import os
from typing import Mapping

from distbelief.runtime import contract, errors
from distbelief.runtime.shard.copies.kubeapi import KubeApi
from distbelief.runtime.shard.copies.kubelease import LeaseViewStore, service_account_owner
from distbelief.runtime.shard.copies.viewstore import FileViewStore, ViewStore

FILE_PREFIX = "file:"
KUBERNETES = "kubernetes"


def open_store(names: contract.JobNames, shard: int, environ: Mapping[str, str] = os.environ, *,
               service_account: str | None = None) -> ViewStore:
    """service_account: where the pod's token, the cluster's CA and its namespace are
    (default: KubeApi.in_cluster's)."""
    setting = environ.get(contract.ENV_VIEW_STORE, "").strip()
    if setting.startswith(FILE_PREFIX) and setting[len(FILE_PREFIX):]:
        return FileViewStore(os.path.join(setting[len(FILE_PREFIX):], f"shard-{shard}.json"))
    if setting == KUBERNETES or (not setting and environ.get("KUBERNETES_SERVICE_HOST")):
        api, namespace = KubeApi.in_cluster(service_account, environ=environ)
        return LeaseViewStore(api, namespace=namespace, name=names.shard_lease(shard),
                              labels=contract.selector_labels(names.job, contract.ROLE_PS),
                              owner=service_account_owner(api))
    if not setting:
        raise errors.ConfigError(f"a job with spec.parameterServers.backups needs a view store: set "
                                 f"{contract.ENV_VIEW_STORE}=file:FOLDER (one machine) or run in a cluster")
    raise errors.ConfigError(f"{contract.ENV_VIEW_STORE}={setting!r}: expected file:FOLDER or {KUBERNETES}")
