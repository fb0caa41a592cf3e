{{/* Names and labels shared by every kelastic template. */}}

{{- define "kelastic.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release-scoped name of everything the chart creates (63 chars at most). */}}
{{- define "kelastic.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kelastic.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kelastic.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kelastic.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kelastic.labels" -}}
helm.sh/chart: {{ include "kelastic.chart" . }}
{{ include "kelastic.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kelastic
{{- end }}

{{- define "kelastic.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kelastic.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false: name an existing ServiceAccount" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kelastic.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The namespaces the operator watches when it is not cluster-wide: the
watchNamespaces value, or the release namespace when that list is empty.
Rendered as a JSON list so templates can `fromJsonArray` it.
*/}}
{{- define "kelastic.watchNamespaces" -}}
{{- if .Values.watchNamespaces }}
{{- .Values.watchNamespaces | uniq | toJson }}
{{- else }}
{{- list .Release.Namespace | toJson }}
{{- end }}
{{- end }}

{{- define "kelastic.leaseName" -}}
{{- include "kelastic.fullname" . }}
{{- end }}

{{/*
The operator's permissions on the objects it manages. Shared by the
namespaced Role and the cluster-wide ClusterRole so both grant the same verbs.
*/}}
{{- define "kelastic.operatorRules" -}}
# ElasticJobs: watch them, read one fresh before acting, delete it after ttlSecondsAfterFinished.
- apiGroups: ["kelastic.dev"]
  resources: ["elasticjobs"]
  verbs: ["get", "list", "watch", "delete"]
# The operator writes only a job's status (a merge patch), never its spec.
- apiGroups: ["kelastic.dev"]
  resources: ["elasticjobs/status"]
  verbs: ["patch"]
# Pods and Services carry an ownerReference to their job with blockOwnerDeletion: true.
# The OwnerReferencesPermissionEnforcement admission plugin accepts that only from a
# client that may update the owner's finalizers.
- apiGroups: ["kelastic.dev"]
  resources: ["elasticjobs/finalizers"]
  verbs: ["update"]
# Worker pods, the rendezvous store pod and its Service: watched (by label), created, deleted.
# Never updated or patched: a change of spec means a new pod.
- apiGroups: [""]
  resources: ["pods", "services"]
  verbs: ["list", "watch", "create", "delete"]
# Each job's Secret, its agents' key: created once, before its first worker pod, and never
# read, listed or changed; the garbage collector removes it with the job (ownerReference).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# The tail of a failed worker's log names its root cause in the job's Failed condition.
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# Events for every action and failure; a repeated Event is patched (count, lastTimestamp).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# Gang scheduling: the PodGroup of a job whose workers use Volcano or the scheduler-plugins
# coscheduling scheduler, or kube-scheduler's own (scheduling.k8s.io, where the cluster serves
# it); created, and patched when the job scales. Removed with the job.
- apiGroups: ["scheduling.volcano.sh", "scheduling.x-k8s.io", "scheduling.k8s.io"]
  resources: ["podgroups"]
  verbs: ["create", "patch"]
{{- if .Values.networkPolicy.enabled }}
# Each job's NetworkPolicies that admit only its pods (and the operator) to its workers and
# its store: created, and patched when they exist already with other labels or spec (an
# operator restarted with other settings); the garbage collector removes them with the job.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "patch"]
{{- end }}
{{- if .Values.kueue.enabled }}
# Kueue (docs/kueue.md): the Workloads through which a queued job asks for its workers
# (watched by label, created, deleted while pending), and their status: the operator
# releases an evicted Workload's quota once its pods are gone, marks pods ready, and
# finishes the Workloads when the job ends.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list", "watch", "create", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- end }}
{{- end }}

{{- /* The Secret holding the operator's master key (every job's secret derives from it). */}}
{{- define "kelastic.keySecretName" -}}
{{- printf "%s-key" (include "kelastic.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end }}
