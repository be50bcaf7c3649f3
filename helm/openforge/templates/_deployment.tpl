{{/*
"openforge.deployment": one OpenForge process as a Deployment. Arguments (dict):
  root       the chart context ($)
  name       component name; also the `openforge <name>` subcommand and the key of its values
  replicas   replica count
  resources  container resources (already adjusted, e.g. GPUs added)
  ports      container ports (list) or nil
  probes     probe block (YAML string) or ""
  mounts     extra volumeMounts (list) or nil
  volumes    extra volumes (list) or nil
  envFrom    envFrom sources (list) or nil
  command    container command replacing the image's `openforge` entrypoint (list) or nil
  token      mount a ServiceAccount token (only launcher and watcher talk to the API server)
  stable     a StatefulSet behind the component's headless Service: each replica has its own
             stable address (the proxy: the launcher pins every rollout to one replica)
  claims     volumeClaimTemplates (list) or nil: (with stable) pods each keep their claims
             through deletion and scale-in
*/}}
{{- define "openforge.deployment" -}}
{{- $root := .root }}
{{- $v := index $root.Values .name }}
{{- $ctx := dict "root" $root "name" .name }}
{{- /* Every process may talk to Kafka: each gets its credentials and certificates (never rollout pods). */}}
{{- $kafkaSecurity := $root.Values.kafka.security }}
{{- $envFrom := .envFrom | default list }}
{{- $mounts := .mounts | default list }}
{{- $volumes := .volumes | default list }}
{{- if and (hasPrefix "SASL_" $kafkaSecurity.protocol) $kafkaSecurity.credentialsSecret }}
{{- $envFrom = append $envFrom (dict "secretRef" (dict "name" $kafkaSecurity.credentialsSecret)) }}
{{- end }}
{{- if $kafkaSecurity.tlsSecret }}
{{- $mounts = append $mounts (dict "name" "kafka-tls" "mountPath" "/etc/openforge/kafka-tls" "readOnly" true) }}
{{- $volumes = append $volumes (dict "name" "kafka-tls" "secret" (dict "secretName" $kafkaSecurity.tlsSecret "defaultMode" 288)) }}
{{- end }}
apiVersion: apps/v1
kind: {{ ternary "StatefulSet" "Deployment" (or (not (empty .stable)) (not (empty .claims))) }}
metadata:
  name: {{ include "openforge.component" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "openforge.labels" $ctx | nindent 4 }}
spec:
  {{- if hasKey . "replicas" }}
  replicas: {{ .replicas }}
  {{- end }}
  {{- if or .stable .claims }}
  serviceName: {{ include "openforge.component" $ctx }}-headless
  # Replicas start and stop together, as a Deployment's do (an update still replaces them one
  # at a time).
  podManagementPolicy: Parallel
  {{- end }}
  {{- with .claims }}
  # Each replica keeps its claim, and what it holds for Kafka, when scaled in or deleted, and
  # ships it when it runs again.
  persistentVolumeClaimRetentionPolicy:
    whenDeleted: Retain
    whenScaled: Retain
  volumeClaimTemplates:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if eq .name "learner" }}
  # One learner owns the optimizer state and the consumed offsets: never two at once.
  strategy:
    type: Recreate
  {{- end }}
  selector:
    matchLabels:
      {{- include "openforge.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "openforge.selectorLabels" $ctx | nindent 8 }}
        {{- include "openforge.stackLabel" $root | nindent 8 }}
      {{- if has .name (list "proxy" "launcher") }}
      annotations:
        # Only the processes that read the signing keys restart when they change: a key rotation
        # takes three upgrades, and the learner (Recreate) would stop training at each.
        checksum/credentials: {{ include (print $root.Template.BasePath "/secret-credentials.yaml") $root | sha256sum | trunc 16 | quote }}
      {{- else if eq .name "ui" }}
      annotations:
        # The credential is read at start: a new one restarts the pod.
        checksum/ui-credential: {{ include (print $root.Template.BasePath "/secret-ui.yaml") $root | sha256sum | trunc 16 | quote }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "openforge.component" $ctx }}
      automountServiceAccountToken: {{ .token | default false }}
      # The process drains for drainSeconds on SIGTERM; Kubernetes must not kill it sooner. After
      # its calls drain, the proxy records those of harnesses that left (10 s at most) and ships
      # what its journal holds (up to three publish timeouts, and 5 s): on an emptyDir (the
      # default spoolVolume), what a killed proxy had not shipped is gone.
      {{- if eq .name "proxy" }}
      terminationGracePeriodSeconds: {{ add $v.drainSeconds 10 (mul 3 $v.publishTimeoutSeconds) 5 15 }}
      {{- else }}
      terminationGracePeriodSeconds: {{ add $v.drainSeconds 15 }}
      {{- end }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        runAsNonRoot: true
        runAsUser: 10001
        runAsGroup: 10001
        fsGroup: 10001
        # Re-own a volume's files only when its root is not ours yet: a spool claim that held
        # many records would otherwise slow every start.
        fsGroupChangePolicy: OnRootMismatch
      containers:
        - name: {{ .name }}
          image: {{ include "openforge.image" $root | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          {{- with .command }}
          command: {{ toJson . }}
          {{- end }}
          args: [{{ .name | quote }}]
          env:
            {{- include "openforge.env" $ctx | trim | nindent 12 }}
          {{- with $envFrom }}
          envFrom:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with .ports }}
          ports:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with .probes }}
          {{- . | nindent 10 }}
          {{- end }}
          resources:
            {{- toYaml .resources | nindent 12 }}
          securityContext:
            {{- include "openforge.containerSecurityContext" $root | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- with $mounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir: {}
        {{- with $volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- include "openforge.scheduling" $v | nindent 6 }}
{{- end }}

{{/* Volume and mount of the credential-signing key Secret. */}}
{{- define "openforge.credentialsVolume" -}}
- name: credentials
  secret:
    secretName: {{ include "openforge.credentialsSecret" . }}
    defaultMode: 0440
{{- end }}
{{- define "openforge.credentialsMount" -}}
- name: credentials
  mountPath: /etc/openforge/credentials
  readOnly: true
{{- end }}

{{/* Volume and mount of the shared checkpoint claim (pvc storage only). */}}
{{- define "openforge.checkpointsVolume" -}}
{{- if eq .Values.checkpoints.storage "pvc" }}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ include "openforge.checkpointsClaim" . }}
{{- end }}
{{- end }}
{{- define "openforge.checkpointsMount" -}}
{{- if eq .root.Values.checkpoints.storage "pvc" }}
- name: checkpoints
  mountPath: {{ .root.Values.checkpoints.mountPath }}
  readOnly: {{ .readOnly }}
{{- end }}
{{- end }}

{{/* envFrom of the object-store credentials (objectStore storage only). */}}
{{- define "openforge.objectStoreEnvFrom" -}}
{{- if and (eq .Values.checkpoints.storage "objectStore") .Values.checkpoints.objectStore.credentialsSecret }}
- secretRef:
    name: {{ .Values.checkpoints.objectStore.credentialsSecret }}
{{- end }}
{{- end }}
