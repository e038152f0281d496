{{/* Names and labels, as in the `helm create` scaffold. */}}
{{- define "breakpod.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's resource name prefix; works from a parent chart too (see breakpod.values). */}}
{{- define "breakpod.fullname" -}}
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

{{- define "breakpod.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "breakpod.labels" -}}
helm.sh/chart: {{ include "breakpod.chart" . }}
{{ include "breakpod.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "breakpod.selectorLabels" -}}
app.kubernetes.io/name: {{ include "breakpod.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "breakpod.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "breakpod.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "breakpod.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{- define "breakpod.tokenSecretName" -}}
{{- .Values.auth.existingSecret | default (include "breakpod.fullname" .) }}
{{- end }}

{{/* REDIS_PASSWORD from the chart's Redis Secret, or redis.existingSecret. */}}
{{- define "breakpod.redisPasswordEnv" -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      {{- include "breakpod.redisPasswordRef" . | nindent 6 }}
{{- end }}

{{- define "breakpod.redisPasswordRef" -}}
name: {{ .Values.redis.existingSecret | default (include "breakpod.redisName" .) }}
key: {{ ternary .Values.redis.existingSecretKey "password" (not (empty .Values.redis.existingSecret)) }}
{{- end }}

{{- define "breakpod.apiScheme" -}}
{{- ternary "https" "http" .Values.broker.tls.enabled }}
{{- end }}

{{- define "breakpod.apiTlsSecret" -}}
{{- if .Values.broker.tls.certManager.enabled }}
{{- printf "%s-api-tls" (include "breakpod.fullname" .) }}
{{- else }}
{{- .Values.broker.tls.secretName }}
{{- end }}
{{- end }}

{{/* The in-release Redis URL carries $(REDIS_PASSWORD), expanded by the kubelet. */}}
{{/* NOTES.txt: a shell command printing the broker token of .role. An
existingSecret holds only the role:token,... list, so the command picks the
first entry of that role from it. */}}
{{- define "breakpod.tokenCommand" -}}
{{- $r := .root }}
{{- $get := printf "kubectl -n %s get secret %s" $r.Release.Namespace (include "breakpod.tokenSecretName" $r) }}
{{- if $r.Values.auth.existingSecret }}
{{- printf "%s -o jsonpath='{.data.%s}' | base64 -d | tr , '\\n' | sed -n 's/^ *%s://p' | head -n 1" $get $r.Values.auth.existingSecretKey .role }}
{{- else }}
{{- printf "%s -o jsonpath='{.data.%s-token}' | base64 -d" $get .role }}
{{- end }}
{{- end }}

{{- define "breakpod.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "breakpod.redisName" .) }}
{{- else }}
{{- .Values.redis.url }}
{{- end }}
{{- end }}

{{- define "breakpod.webhookTlsSecret" -}}
{{- if .Values.webhook.tls.certManager.enabled }}
{{- printf "%s-webhook-tls" (include "breakpod.fullname" .) }}
{{- else }}
{{- .Values.webhook.tls.secretName }}
{{- end }}
{{- end }}

{{/*
Values that make no sense fail the render with the value to fix.
(Types, ranges and enums are in values.schema.json.)
*/}}
{{- define "breakpod.validate" -}}
{{- $v := .Values }}
{{- if and $v.webhook.enabled (lt (int $v.broker.replicaCount) 1) }}
{{- fail "broker.replicaCount is 0 while webhook.enabled is true: the API server would find no webhook pod and debugged pods would start without the overlay. Set broker.replicaCount to 1 or more, or webhook.enabled=false." }}
{{- end }}
{{- if regexMatch "://[^/@]*:[^/@]+@" $v.redis.url }}
{{- fail "redis.url holds a password: it would be a plain env value in the broker pod. Put the URL in a Secret and set redis.urlSecret.name (and .key) instead." }}
{{- end }}
{{- if and $v.broker.tls.enabled (not $v.broker.tls.certManager.enabled) (not $v.broker.tls.secretName) }}
{{- fail "broker.tls.enabled is true but broker.tls.secretName is empty and broker.tls.certManager.enabled is false: the API needs a certificate. Set one of them." }}
{{- end }}
{{- if and (not $v.redis.enabled) (not $v.redis.url) (not $v.redis.urlSecret.name) }}
{{- fail "redis.enabled is false and redis.url is empty: the broker replicas need one shared Redis. Set redis.url=redis://HOST:6379/0 or redis.enabled=true." }}
{{- end }}
{{- if and $v.redis.enabled (or $v.redis.url $v.redis.urlSecret.name) }}
{{- fail "redis.url is set while redis.enabled is true: pick one. Set redis.enabled=false to use the external Redis, or redis.url=\"\"." }}
{{- end }}
{{- if and (not $v.redis.enabled) $v.redis.existingSecret }}
{{- fail "redis.existingSecret is set while redis.enabled is false: it holds the in-release Redis password. Put the external Redis password in redis.url (redis://:PASSWORD@HOST:6379/0), or set redis.enabled=true." }}
{{- end }}
{{- if and $v.webhook.enabled (not $v.webhook.tls.certManager.enabled) (not $v.webhook.tls.secretName) }}
{{- fail "webhook.tls.secretName is empty while webhook.tls.certManager.enabled is false: the webhook needs a serving certificate. Set webhook.tls.secretName (a kubernetes.io/tls Secret) or webhook.tls.certManager.enabled=true." }}
{{- end }}
{{- if and $v.webhook.enabled (not $v.webhook.tls.certManager.enabled) (not $v.webhook.tls.caBundle) }}
{{- fail "webhook.tls.caBundle is empty while webhook.tls.certManager.enabled is false: the API server must trust the webhook certificate. Set webhook.tls.caBundle to the base64 PEM of its CA." }}
{{- end }}
{{- if and (not (has $v.overlay.listenHost (list "127.0.0.1" "localhost" "::1"))) (not $v.overlay.tokenSecret.name) }}
{{- fail (printf "overlay.listenHost is %s but overlay.tokenSecret.name is empty: breakpod refuses a non-loopback pdb listener without a token. Set overlay.tokenSecret.name, or overlay.listenHost=127.0.0.1 (kubectl port-forward reaches it)." $v.overlay.listenHost) }}
{{- end }}
{{- if eq (int $v.overlay.port) (int $v.broker.port) }}
{{- fail "overlay.port equals broker.port: pick a different debug port for training pods (overlay.port, default 5678)." }}
{{- end }}
{{- if regexMatch "[?&]password=" $v.redis.url }}
{{- fail "redis.url holds a password (?password=): it would be a plain env value in the broker pod. Put the URL in a Secret and set redis.urlSecret.name (and .key) instead." }}
{{- end }}
{{- if and $v.webhook.enabled (eq (int $v.webhook.port) (int $v.broker.port)) }}
{{- fail "webhook.port equals broker.port: both listen in the broker pod. Pick another webhook.port (default 8443)." }}
{{- end }}
{{- if and $v.webhook.enabled (eq (int $v.service.port) 443) }}
{{- fail "service.port is 443, the port the Service gives the webhook: pick another service.port (default 8765)." }}
{{- end }}
{{- if and (gt (int $v.broker.replicaCount) 1) (ge (int $v.broker.pdbMinAvailable) (int $v.broker.replicaCount)) }}
{{- fail (printf "broker.pdbMinAvailable (%v) is not below broker.replicaCount (%v): no broker pod could ever be evicted, and node drains would hang. Lower it." $v.broker.pdbMinAvailable $v.broker.replicaCount) }}
{{- end }}
{{- $names := list }}
{{- range (include "breakpod.overlay" . | fromYaml).container.env }}
{{- if has .name $names }}
{{- fail (printf "overlay.extraEnv sets %s, which the overlay sets itself or extraEnv sets twice (the last would win, past the chart's checks): set it once, through its own value." .name) }}
{{- end }}
{{- $names = append $names .name }}
{{- end }}
{{- end }}

{{/* The in-release Redis's name: short enough for a Service (63) and for the
StatefulSet's controller-revision-hash label (its name, "-" and 10 characters). */}}
{{- define "breakpod.redisName" -}}
{{- printf "%s-redis" (include "breakpod.fullname" . | trunc 46 | trimSuffix "-") }}
{{- end }}
