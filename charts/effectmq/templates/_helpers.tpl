{{/* Chart name, truncated to a DNS label. */}}
{{- define "effectmq.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the release name, prefixed with the chart name unless it contains it. */}}
{{- define "effectmq.fullname" -}}
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

{{- define "effectmq.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Recommended labels (app.kubernetes.io/*); pass a dict with "ctx" and "component". */}}
{{- define "effectmq.labels" -}}
helm.sh/chart: {{ include "effectmq.chart" .ctx }}
{{ include "effectmq.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: effectmq
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{/* Selector labels: stable across upgrades (selectors are immutable). */}}
{{- define "effectmq.selectorLabels" -}}
app.kubernetes.io/name: {{ include "effectmq.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "effectmq.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "effectmq.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "effectmq.leaseName" -}}
{{- default (include "effectmq.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/* Cluster-scoped objects carry the release namespace: two releases never collide. */}}
{{- define "effectmq.clusterName" -}}
{{- printf "%s-%s" (include "effectmq.fullname" .) .Release.Namespace }}
{{- end }}

{{- define "effectmq.redisName" -}}
{{- printf "%s-redis" (include "effectmq.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The bundled Redis's address, without credentials. */}}
{{- define "effectmq.redisAddress" -}}
{{- printf "%s.%s.svc:6379" (include "effectmq.redisName" .) .Release.Namespace }}
{{- end }}

{{/* The Secret holding the bundled Redis's password and URL: the user's or the generated one. */}}
{{- define "effectmq.redisSecret" -}}
{{- default (include "effectmq.redisName" .) .Values.redis.auth.existingSecret }}
{{- end }}

{{- define "effectmq.redisPasswordKey" -}}
{{- if .Values.redis.auth.existingSecret }}{{ .Values.redis.auth.existingSecretPasswordKey }}{{ else }}password{{ end }}
{{- end }}

{{- define "effectmq.redisUrlKey" -}}
{{- if .Values.redis.auth.existingSecret }}{{ .Values.redis.auth.existingSecretUrlKey }}{{ else }}url{{ end }}
{{- end }}

{{/* The labels the operator puts on every worker pod (operator/effectmq_operator/builders.py, worker_labels). */}}
{{- define "effectmq.workerPodLabels" -}}
app.kubernetes.io/name: effectmq-worker
app.kubernetes.io/managed-by: effectmq-operator
{{- end }}

{{/* The release namespace, then watchNamespaces: where the release's worker pods run. */}}
{{- define "effectmq.workerNamespaces" -}}
{{- toJson (uniq (prepend .Values.watchNamespaces .Release.Namespace)) }}
{{- end }}

{{/* repository:tag or repository@digest; pass a dict with "image" and "default" (tag). */}}
{{- define "effectmq.image" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .default .image.tag) }}
{{- end }}
{{- end }}

{{/* Checks that a JSON schema cannot express. */}}
{{- define "effectmq.validate" -}}
{{- if eq (int .Values.metrics.port) (int .Values.liveness.port) }}
{{- fail (printf "metrics.port and liveness.port must differ (both are %v)" .Values.metrics.port) }}
{{- end }}
{{- end }}

{{- define "effectmq.dashboardName" -}}
{{- printf "%s-dashboard" (include "effectmq.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Secret key that holds the dashboard's Redis URL, as JSON {name, key}, or {} when
the URL is not secret (a literal one, or the bundled Redis without a password). */}}
{{- define "effectmq.dashboardRedisSecretRef" -}}
{{- $redis := .Values.dashboard.redis -}}
{{- if $redis.existingSecret }}
{{- toJson (dict "name" $redis.existingSecret "key" $redis.existingSecretKey) }}
{{- else if and (not $redis.url) .Values.redis.enabled .Values.redis.auth.enabled }}
{{- toJson (dict "name" (include "effectmq.redisSecret" .) "key" (include "effectmq.redisUrlKey" .)) }}
{{- else }}
{{- toJson (dict) }}
{{- end }}
{{- end }}

{{/* The dashboard's Redis URL: from a Secret, mounted as a file (EFFECTMQ_REDIS_URL_FILE: a
URL with a password stays out of the environment, which child processes and crash dumps
inherit); a literal URL; or the bundled Redis without a password. */}}
{{- define "effectmq.dashboardRedisEnv" -}}
{{- $redis := .Values.dashboard.redis -}}
{{- $ref := include "effectmq.dashboardRedisSecretRef" . | fromJson -}}
{{- if $ref.name }}
- name: EFFECTMQ_REDIS_URL_FILE
  value: /etc/effectmq-redis/url
{{- else if $redis.url }}
- name: EFFECTMQ_REDIS_URL
  value: {{ $redis.url | quote }}
{{- else if .Values.redis.enabled }}
- name: EFFECTMQ_REDIS_URL
  value: {{ printf "redis://%s/0" (include "effectmq.redisAddress" .) | quote }}
{{- else }}
{{- fail "dashboard.enabled needs a Redis: set dashboard.redis.existingSecret (a Secret holding the URL), dashboard.redis.url, or redis.enabled" }}
{{- end }}
{{- end }}
