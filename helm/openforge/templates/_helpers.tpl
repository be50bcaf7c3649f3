{{/* Names, labels and small shared blocks. Environment variables live in _env.tpl. */}}

{{- define "openforge.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "openforge.fullname" -}}
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

{{/* "openforge.component" (dict "root" $ "name" "proxy"): a component's resource name. */}}
{{- define "openforge.component" -}}
{{- printf "%s-%s" (include "openforge.fullname" .root) .name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "openforge.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels of one component. Every stack pod also carries openforge.io/stack=<release>, which the
NetworkPolicies use to tell stack pods from rollout pods (the launcher never puts it on rollout pods).
*/}}
{{- define "openforge.selectorLabels" -}}
app.kubernetes.io/name: {{ include "openforge.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .name }}
{{- end }}

{{- define "openforge.labels" -}}
helm.sh/chart: {{ include "openforge.chart" .root }}
{{ include "openforge.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: openforge
{{- end }}

{{- define "openforge.stackLabel" -}}
openforge.io/stack: {{ .Release.Name }}
{{- end }}

{{- define "openforge.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "openforge.rolloutNamespace" -}}
{{- default .Release.Namespace .Values.rollouts.namespace }}
{{- end }}

{{- define "openforge.credentialsSecret" -}}
{{- default (include "openforge.component" (dict "root" . "name" "credentials")) .Values.credentials.existingSecret }}
{{- end }}

{{- define "openforge.uiSecret" -}}
{{- default (include "openforge.component" (dict "root" . "name" "ui")) .Values.ui.existingSecret }}
{{- end }}

{{- define "openforge.checkpointsClaim" -}}
{{- default (include "openforge.component" (dict "root" . "name" "checkpoints")) .Values.checkpoints.pvc.existingClaim }}
{{- end }}

{{- define "openforge.kafkaClusterName" -}}
{{- include "openforge.component" (dict "root" . "name" "kafka") }}
{{- end }}

{{- define "openforge.kafkaBootstrap" -}}
{{- if eq .Values.kafka.mode "strimzi" }}
{{- printf "%s-kafka-bootstrap:9092" (include "openforge.kafkaClusterName" .) }}
{{- else }}
{{- required "kafka.bootstrapServers is required when kafka.mode is external" .Values.kafka.bootstrapServers }}
{{- end }}
{{- end }}

{{/* Comma-separated URLs of every vLLM replica: the proxy routes over them, the publisher reloads each. */}}
{{- define "openforge.vllmUpstreams" -}}
{{- $name := include "openforge.component" (dict "root" . "name" "vllm") }}
{{- $urls := list }}
{{- range $i := until (int .Values.vllm.replicas) }}
{{- $urls = append $urls (printf "http://%s-%d.%s-headless.%s.svc:8000" $name $i $name $.Release.Namespace) }}
{{- end }}
{{- join "," $urls }}
{{- end }}

{{- define "openforge.otelEndpoint" -}}
{{- if .Values.otel.collector.enabled }}
{{- printf "http://%s:4318" (include "openforge.component" (dict "root" . "name" "otel-collector")) }}
{{- else }}
{{- .Values.otel.endpoint }}
{{- end }}
{{- end }}

{{/* Hardened container security context shared by every OpenForge container. */}}
{{- define "openforge.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* "openforge.scheduling" .Values.<component>: nodeSelector, tolerations, affinity. */}}
{{- define "openforge.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The proxy's workload kind: a StatefulSet when its spool lives on claims of its own (one place for it). */}}

{{- /* Each proxy replica's own address, comma-separated: the launcher pins every rollout to one,
so its calls and its verifier's reward pass through the same replica. */}}
{{- define "openforge.proxyReplicaURLs" -}}
{{- $name := include "openforge.component" (dict "root" . "name" "proxy") }}
{{- $urls := list }}
{{- range $i := until (int .Values.proxy.replicas) }}
{{- $urls = append $urls (printf "http://%s-%d.%s-headless.%s.svc:%v" $name $i $name $.Release.Namespace $.Values.proxy.port) }}
{{- end }}
{{- join "," $urls }}
{{- end }}
