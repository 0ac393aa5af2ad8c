{{/*
Names, labels and the few derived values every template shares.
*/}}

{{/* The release's full name: the release name, with the chart's name unless it holds it. */}}
{{- define "distbelief.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Cluster-scoped objects carry the release namespace too: two releases in two
namespaces (each watching its own namespaces) must not share a ClusterRole. */}}
{{- define "distbelief.clusterName" -}}
{{- printf "%s-%s" (include "distbelief.fullname" .) .Release.Namespace | trunc 253 | trimSuffix "-" -}}
{{- end -}}

{{- define "distbelief.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "distbelief.labels" -}}
{{ include "distbelief.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "distbelief.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "distbelief.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* repository@digest when a digest is given, else repository:tag (tag: the appVersion). */}}
{{- define "distbelief.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "distbelief.runtimeImage" -}}
{{- default (printf "distbelief/distbelief:%s" (default .Chart.AppVersion .Values.image.tag)) .Values.runtimeImage -}}
{{- end -}}

{{/* Whether the operator watches every namespace (ClusterRole, ClusterKopfPeering). */}}
{{- define "distbelief.clusterwide" -}}
{{- if not .Values.operator.watchNamespaces -}}true{{- end -}}
{{- end -}}

{{/* The labels of the pods the operator renders for jobs (render.labels in the operator). */}}
{{- define "distbelief.jobPodLabels" -}}
app.kubernetes.io/name: distbelief
app.kubernetes.io/managed-by: distbelief-operator
{{- end -}}

{{/* Prometheus Operator namespaceSelector: the watched namespaces, or all of them. */}}
{{- define "distbelief.monitorNamespaces" -}}
{{- if include "distbelief.clusterwide" . -}}
any: true
{{- else -}}
matchNames:
{{- toYaml .Values.operator.watchNamespaces | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* The operator's rules on the objects of one namespace: exactly the calls it makes
(tests/integration/test_chart.py runs the operator and compares). Kept in one place for the
ClusterRole (all namespaces) and the per-namespace Roles. */}}
{{- define "distbelief.namespacedRules" -}}
# kopf: watches DistBeliefJobs, keeps its progress in their annotations, writes status;
# the operator reads a job afresh when one of its children changed, and deletes a
# finished job once runPolicy.ttlSecondsAfterFinished has passed.
- apiGroups: [distbelief.io]
  resources: [distbeliefjobs]
  verbs: [get, list, watch, patch, delete]
- apiGroups: [distbelief.io]
  resources: [distbeliefjobs/status]
  verbs: [patch]
# The children's owner references set blockOwnerDeletion (the garbage collector deletes
# them before the job in a foreground deletion). A server with the admission plugin
# OwnerReferencesPermissionEnforcement (OpenShift, hardened clusters) admits that only from a
# client that may update the owner's finalizers; the operator never calls this itself.
- apiGroups: [distbelief.io]
  resources: [distbeliefjobs/finalizers]
  verbs: [update]
# The children of a job: watched (a child deleted or changed is put back), read, created
# when missing, patched toward the spec; only those the job controls (owner reference).
- apiGroups: [""]
  resources: [configmaps, services]
  verbs: [get, list, watch, create, patch]
- apiGroups: [apps]
  resources: [statefulsets, deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
# ... and the autoscaler, removed again when the spec stops asking for one.
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, patch, delete]
# ... and the shards' NetworkPolicy, likewise removed when the spec stops asking for it.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
# Before a new job's first children: checkpoint claims an earlier job of the same name left.
# A reshard to more shards: the new shard pods' claims, made before their pods.
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [list, create]
# A reshard's Job <job>-reshard: created once the job's pods stopped, read while it runs,
# deleted once its new shard count is the job's.
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, create, delete]
# With spec.parameterServers.backups: the shard pods' ServiceAccount, and the Role and
# RoleBinding that let it keep the shards' view Leases <job>-shard-<i>. A role may grant
# only what its maker holds, hence the leases rule below (the operator itself never calls it).
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, patch]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [get, create, update]
# The job's CurveZMQ key Secret <job>-keys: created, and never read, listed, patched or
# deleted (it is immutable; the job's deletion takes it). The job's annotation
# distbelief.io/keys-secret-uid, not a read, tells its own Secret from a planted one.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
# The jobs' pods, watched for the jobs' status: restarts (runPolicy.backoffLimit), how
# containers ended.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
# kopf's Events on the jobs (phase changes, children applied).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# A job labelled kueue.x-k8s.io/queue-name: its Workload (owned by the job, the garbage
# collector deletes it with the job), created, read, and deleted and made anew when the job
# is scaled while it waits; its status written at an eviction (the admission given back)
# and at the end (Finished).
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, create, delete]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [patch]
{{- end -}}
