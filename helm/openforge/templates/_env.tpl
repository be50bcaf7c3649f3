{{/*
The one place that maps chart values onto the processes' environment variables.

Each process reads pydantic settings with its own prefix (OPENFORGE_<PROCESS>_*) plus the shared Kafka
settings (OPENFORGE_KAFKA_*) and the standard OpenTelemetry variables (OTEL_*). When a process renames a
setting, change it here and nowhere else. `<component>.extraEnv` in values overrides any of these by name.
*/}}

{{- define "openforge.env.kafka" -}}
OPENFORGE_KAFKA_BOOTSTRAP_SERVERS: {{ include "openforge.kafkaBootstrap" . | quote }}
OPENFORGE_KAFKA_TOPIC_PREFIX: {{ .Values.kafka.topicPrefix | quote }}
OPENFORGE_KAFKA_COMPRESSION: {{ .Values.kafka.compression | quote }}
OPENFORGE_KAFKA_CLIENT_ID: {{ include "openforge.fullname" . | quote }}
{{- if eq .Values.kafka.mode "strimzi" }}
OPENFORGE_KAFKA_REPLICATION_FACTOR: {{ .Values.kafka.strimzi.replicationFactor | quote }}
{{- end }}
{{- include "openforge.kafkaSecurityChecked" . }}
{{- with .Values.kafka.security }}
{{- if ne .protocol "PLAINTEXT" }}
OPENFORGE_KAFKA_SECURITY_PROTOCOL: {{ .protocol | quote }}
{{- end }}
{{- if hasPrefix "SASL_" .protocol }}
OPENFORGE_KAFKA_SASL_MECHANISM: {{ .saslMechanism | quote }}
{{- end }}
{{- if .oauthTokenUrl }}
OPENFORGE_KAFKA_SASL_OAUTH_TOKEN_URL: {{ .oauthTokenUrl | quote }}
{{- end }}
{{- if .oauthScope }}
OPENFORGE_KAFKA_SASL_OAUTH_SCOPE: {{ .oauthScope | quote }}
{{- end }}
{{- if .oauthHeaderUrlencode }}
OPENFORGE_KAFKA_SASL_OAUTH_HEADER_URLENCODE: "true"
{{- end }}
{{- if .oauthExtensions }}
{{- $pairs := list }}
{{- range $key, $value := .oauthExtensions }}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) }}
{{- end }}
OPENFORGE_KAFKA_SASL_OAUTH_EXTENSIONS: {{ join "," $pairs | quote }}
{{- end }}
{{- if .tlsSecret }}
OPENFORGE_KAFKA_SSL_CAFILE: "/etc/openforge/kafka-tls/ca.crt"
{{- if .oauthTrustsTlsSecretCa }}
OPENFORGE_KAFKA_SASL_OAUTH_CA_FILE: "/etc/openforge/kafka-tls/ca.crt"
{{- end }}
{{- if .clientCertificate }}
OPENFORGE_KAFKA_SSL_CERTFILE: "/etc/openforge/kafka-tls/tls.crt"
OPENFORGE_KAFKA_SSL_KEYFILE: "/etc/openforge/kafka-tls/tls.key"
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
kafka.security as a whole, refused with the value to fix when half set or set where it cannot
apply (the processes would refuse it too, but only after the pods start, one crash loop each).
*/}}
{{- define "openforge.kafkaSecurityChecked" -}}
{{- $s := .Values.kafka.security }}
{{- $sasl := hasPrefix "SASL_" $s.protocol }}
{{- $tls := hasSuffix "SSL" $s.protocol }}
{{- if and (eq .Values.kafka.mode "strimzi") (or (ne $s.protocol "PLAINTEXT") $s.saslMechanism $s.credentialsSecret $s.tlsSecret $s.clientCertificate $s.oauthTokenUrl $s.oauthScope $s.oauthTrustsTlsSecretCa $s.oauthHeaderUrlencode $s.oauthExtensions) }}
{{- fail "kafka.security applies to kafka.mode external; the Strimzi cluster is reached on its in-namespace listener" }}
{{- end }}
{{- if and $sasl (not (and $s.saslMechanism $s.credentialsSecret)) }}
{{- fail (printf "kafka.security.protocol %s needs kafka.security.saslMechanism and kafka.security.credentialsSecret" $s.protocol) }}
{{- end }}
{{- if and (not $sasl) (or $s.saslMechanism $s.credentialsSecret) }}
{{- fail (printf "kafka.security.saslMechanism and credentialsSecret need protocol SASL_SSL or SASL_PLAINTEXT, not %s" $s.protocol) }}
{{- end }}
{{- $oauth := eq $s.saslMechanism "OAUTHBEARER" }}
{{- if and $oauth (not $s.oauthTokenUrl) }}
{{- fail "kafka.security.saslMechanism OAUTHBEARER needs kafka.security.oauthTokenUrl (the identity provider's token endpoint)" }}
{{- end }}
{{- if and (not $oauth) (or $s.oauthTokenUrl $s.oauthScope $s.oauthTrustsTlsSecretCa $s.oauthHeaderUrlencode $s.oauthExtensions) }}
{{- fail "kafka.security.oauthTokenUrl, oauthScope, oauthTrustsTlsSecretCa, oauthHeaderUrlencode and oauthExtensions need saslMechanism OAUTHBEARER" }}
{{- end }}
{{- if and $s.oauthTrustsTlsSecretCa (not $s.tlsSecret) }}
{{- fail "kafka.security.oauthTrustsTlsSecretCa needs kafka.security.tlsSecret (its ca.crt)" }}
{{- end }}
{{- if and (not $tls) $s.tlsSecret }}
{{- fail (printf "kafka.security.tlsSecret needs protocol SSL or SASL_SSL, not %s" $s.protocol) }}
{{- end }}
{{- if and $s.clientCertificate (not $s.tlsSecret) }}
{{- fail "kafka.security.clientCertificate needs kafka.security.tlsSecret (its tls.crt and tls.key)" }}
{{- end }}
{{- end }}

{{/*
The root filesystem is read-only: point HOME and caches (torch, Hugging Face, pip) at the /tmp emptyDir.
*/}}
{{- define "openforge.env.common" -}}
HOME: "/tmp"
XDG_CACHE_HOME: "/tmp/.cache"
{{- end }}

{{- define "openforge.env.otel" -}}
{{- $endpoint := include "openforge.otelEndpoint" .root }}
OTEL_SERVICE_NAME: {{ printf "openforge-%s" .name | quote }}
{{- if $endpoint }}
OTEL_EXPORTER_OTLP_ENDPOINT: {{ $endpoint | quote }}
OTEL_EXPORTER_OTLP_PROTOCOL: {{ .root.Values.otel.protocol | quote }}
OTEL_METRICS_EXPORTER: "otlp"
OTEL_TRACES_EXPORTER: "otlp"
OTEL_METRIC_EXPORT_INTERVAL: {{ .root.Values.otel.metricExportIntervalMs | quote }}
{{- else }}
OTEL_METRICS_EXPORTER: "none"
OTEL_TRACES_EXPORTER: "none"
{{- end }}
OTEL_RESOURCE_ATTRIBUTES: "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),service.namespace=openforge"
{{- end }}

{{/* Process-specific variables, by component name. */}}
{{- define "openforge.env.proxy" -}}
{{- $v := .Values.proxy }}
OPENFORGE_PROXY_HOST: "0.0.0.0"
OPENFORGE_PROXY_PORT: {{ $v.port | quote }}
OPENFORGE_PROXY_UPSTREAMS: {{ include "openforge.vllmUpstreams" . | quote }}
OPENFORGE_PROXY_SERVED_MODEL: {{ .Values.vllm.servedModelName | quote }}
OPENFORGE_PROXY_CREDENTIAL_KEY_FILE: "/etc/openforge/credentials/signing-key"
OPENFORGE_PROXY_CREDENTIAL_OTHER_KEY_FILE: "/etc/openforge/credentials/other-signing-key"
OPENFORGE_PROXY_ALLOW_ANONYMOUS: {{ $v.allowAnonymous | quote }}
OPENFORGE_PROXY_SPOOL_DIR: "/var/spool/openforge"
OPENFORGE_PROXY_SPOOL_MAX_BYTES: {{ include "openforge.spoolMaxBytes" . | quote }}
OPENFORGE_PROXY_SAMPLING: {{ $v.sampling | default dict | toJson | quote }}
OPENFORGE_PROXY_IMAGES: {{ $v.images | quote }}
OPENFORGE_PROXY_DRAIN_S: {{ $v.drainSeconds | quote }}
OPENFORGE_PROXY_PUBLISH_TIMEOUT_S: {{ $v.publishTimeoutSeconds | quote }}
{{- end }}

{{- define "openforge.env.launcher" -}}
{{- $v := .Values.launcher }}
OPENFORGE_LAUNCHER_BACKEND: {{ $v.backend | quote }}
OPENFORGE_LAUNCHER_PROXY_URL: {{ include "openforge.proxyReplicaURLs" . | quote }}
OPENFORGE_LAUNCHER_CREDENTIAL_KEY_FILE: "/etc/openforge/credentials/signing-key"
OPENFORGE_LAUNCHER_MAX_IN_FLIGHT: {{ $v.maxInFlight | quote }}
{{- if and $v.pace (not .Values.learner.enabled) }}
{{- fail "launcher.pace needs the learner (learner.enabled): the launcher starts rollouts as fast as the learner can train them, so without one it would start none; set launcher.pace=false to collect rollouts without training" }}
{{- end }}
OPENFORGE_LAUNCHER_PACE: {{ $v.pace | quote }}
{{- if $v.pace }}
OPENFORGE_LAUNCHER_LEARNER_MODEL: {{ .Values.vllm.servedModelName | quote }}
{{- end }}
OPENFORGE_KUBE_NAMESPACE: {{ include "openforge.rolloutNamespace" . | quote }}
OPENFORGE_KUBE_IN_CLUSTER: "true"
OPENFORGE_KUBE_VERIFIER_IMAGE: {{ $v.rolloutImage | quote }}
{{- end }}

{{/* The watcher finds rollout pods by the label the launcher always sets (its default selector). */}}
{{- define "openforge.env.watcher" -}}
OPENFORGE_WATCHER_NAMESPACE: {{ include "openforge.rolloutNamespace" . | quote }}
OPENFORGE_KUBE_NAMESPACE: {{ include "openforge.rolloutNamespace" . | quote }}
OPENFORGE_KUBE_IN_CLUSTER: "true"
{{- end }}

{{- define "openforge.env.assembler" -}}
OPENFORGE_ASSEMBLER_GROUP_ID: {{ printf "%s-assembler" (include "openforge.fullname" .) | quote }}
OPENFORGE_ASSEMBLER_DRAIN_TIMEOUT_S: {{ .Values.assembler.drainSeconds | quote }}
{{- end }}

{{/*
Checkpoints are folders on a filesystem the learner writes and the publisher and vLLM read (the event
carries the folder's path); no process reads an object-store URL yet, so that storage fails the render.
*/}}
{{- define "openforge.env.checkpoints" -}}
{{- if ne .Values.checkpoints.storage "pvc" -}}
{{- fail "checkpoints.storage=objectStore is not supported yet: the learner, publisher and vLLM share checkpoint folders on a filesystem; use checkpoints.storage=pvc" -}}
{{- end -}}
OPENFORGE_LEARNER_CHECKPOINT_DIR: {{ .Values.checkpoints.mountPath | quote }}
{{- end }}

{{- define "openforge.env.learner" -}}
{{- $v := .Values.learner }}
OPENFORGE_LEARNER_DEVICE: {{ ternary "cuda" "cpu" $v.gpu.enabled | quote }}
{{- /* Several GPUs: one rank per GPU under torchrun, the model sharded with FSDP2. */}}
OPENFORGE_LEARNER_ENGINE: {{ ternary "fsdp" "hf" (include "openforge.learnerRanks" . | int | lt 1) | quote }}
OPENFORGE_LEARNER_MODEL_DIR: {{ .Values.vllm.model | quote }}
OPENFORGE_LEARNER_MODEL_NAME: {{ .Values.vllm.servedModelName | quote }}
{{- if not .Values.publisher.enabled }}
{{- fail "learner.enabled needs publisher.enabled: without the publisher the engines keep serving the initial weights, every sampled token is one version older with each checkpoint, and training stops for good once they are learner.maxStaleness versions behind; enable the publisher (or disable the learner)" }}
{{- end }}
OPENFORGE_LEARNER_MAX_STALENESS: {{ $v.maxStaleness | quote }}
OPENFORGE_LEARNER_CHECKPOINT_EVERY: {{ $v.checkpointEvery | quote }}
OPENFORGE_LEARNER_STATE_EVERY: {{ $v.stateEvery | quote }}
OPENFORGE_LEARNER_SERVING_DTYPE: {{ $v.servingDtype | quote }}
OPENFORGE_LEARNER_GRADIENT_CHECKPOINTING: {{ $v.gradientCheckpointing | quote }}
OPENFORGE_LEARNER_SERVING_KEEP_LAST: {{ $v.retention.servingKeepLast | quote }}
OPENFORGE_LEARNER_STATE_KEEP_LAST: {{ $v.retention.stateKeepLast | quote }}
{{- with $v.retention.servingKeepEvery }}
OPENFORGE_LEARNER_SERVING_KEEP_EVERY: {{ . | quote }}
{{- end }}
{{- with $v.retention.stateKeepEvery }}
OPENFORGE_LEARNER_STATE_KEEP_EVERY: {{ . | quote }}
{{- end }}
OPENFORGE_LEARNER_DRAIN_TIMEOUT_S: {{ $v.drainSeconds | quote }}
{{ include "openforge.env.checkpoints" . }}
{{- end }}

{{/* "openforge.learnerRanks": learner processes in the pod, one per GPU (1 on CPU). */}}
{{- define "openforge.learnerRanks" -}}
{{- if .Values.learner.gpu.enabled }}{{ .Values.learner.gpu.count | int }}{{ else }}1{{ end -}}
{{- end }}

{{/* The flight recorder listens on every address of its pod: its credential is what guards it. */}}
{{- define "openforge.env.ui" -}}
{{- $v := .Values.ui }}
OPENFORGE_UI_HOST: "0.0.0.0"
OPENFORGE_UI_PORT: {{ $v.port | quote }}
OPENFORGE_UI_CREDENTIAL_FILE: "/etc/openforge/ui/credential"
OPENFORGE_UI_INDEX_PATH: "/var/lib/openforge-ui/index.sqlite"
OPENFORGE_UI_MAX_ROLLOUTS: {{ $v.maxRollouts | quote }}
OPENFORGE_UI_TRACE_URL: {{ $v.traceUrl | quote }}
OPENFORGE_CONSUMER_DRAIN_TIMEOUT_S: {{ $v.drainSeconds | quote }}
{{- end }}

{{- define "openforge.env.publisher" -}}
OPENFORGE_PUBLISHER_REPLICAS: {{ include "openforge.vllmUpstreams" . | quote }}
OPENFORGE_PUBLISHER_MODEL: {{ .Values.vllm.servedModelName | quote }}
{{- end }}

{{/*
"openforge.env" (dict "root" $ "name" "proxy"): the container's env list. Pod name and namespace come
first (OTEL_RESOURCE_ATTRIBUTES refers to them), then every variable sorted by name.
*/}}
{{- define "openforge.env" -}}
{{- $root := .root }}
{{- $vars := dict }}
{{- $vars = merge $vars (include "openforge.env.common" $root | fromYaml) }}
{{- $vars = merge $vars (include "openforge.env.kafka" $root | fromYaml) }}
{{- $vars = merge $vars (include "openforge.env.otel" (dict "root" $root "name" .name) | fromYaml) }}
{{- $vars = merge $vars (include (printf "openforge.env.%s" .name) $root | fromYaml) }}
{{- $extra := default dict (index $root.Values .name).extraEnv }}
{{- /* The pod's grace period follows these; an override in extraEnv would leave it too short. */}}
{{- range $owned := list "OPENFORGE_PROXY_DRAIN_S" "OPENFORGE_PROXY_PUBLISH_TIMEOUT_S" "OPENFORGE_ASSEMBLER_DRAIN_TIMEOUT_S" "OPENFORGE_LEARNER_DRAIN_TIMEOUT_S" }}
{{- if hasKey $extra $owned }}
{{- fail (printf "%s.extraEnv sets %s, which the chart derives from %s.drainSeconds or %s.publishTimeoutSeconds (the pod's grace period follows them): set those instead" $.name $owned $.name $.name) }}
{{- end }}
{{- end }}
{{- $vars = merge (deepCopy $extra) $vars }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- range $key := keys $vars | sortAlpha }}
- name: {{ $key }}
  value: {{ index $vars $key | toString | quote }}
{{- end }}
{{- end }}

{{/*
What may wait for Kafka in the proxy's spool volume: its size (spoolSizeLimit, whole Gi or Ti, as
the schema requires) less 512 MiB for the journal's open segments and the filesystem. The proxy
answers 503 at this bound; a volume that filled first would fail writes, and an emptyDir over its
limit gets the pod evicted with everything on it.
*/}}
{{- define "openforge.spoolMaxBytes" -}}
{{- $size := .Values.proxy.spoolSizeLimit }}
{{- $count := regexFind "^[0-9]+" $size | int64 }}
{{- $unit := ternary 1099511627776 1073741824 (hasSuffix "Ti" $size) }}
{{- sub (mul $count $unit) 536870912 }}
{{- end }}
