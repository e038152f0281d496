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

{{/* The broker image (broker, webhook, helm test pod): no registry holds a
default, so an empty repository fails the render with the value to set. */}}
{{- define "breakpod.image" -}}
{{- $i := .Values.image }}
{{- if not $i.repository }}
{{- fail "image.repository is empty: no public registry holds the breakpod-broker image. Build it with `make images`, push it to a registry your nodes pull from, and set image.repository (e.g. registry.example.com/ml/breakpod-broker)." }}
{{- end }}
{{- $ref := printf "%s:%s" $i.repository ($i.tag | default .Chart.AppVersion) }}
{{- if $i.digest }}{{ $ref = printf "%s@%s" $ref $i.digest }}{{ end }}
{{- $ref }}
{{- end }}

{{/* Redis by digest (the tag stays for the reader), or by tag on explicit opt-in. */}}
{{- define "breakpod.redisImage" -}}
{{- $i := .Values.redis.image }}
{{- if $i.digest }}
{{- printf "%s:%s@%s" $i.repository $i.tag $i.digest }}
{{- else if $i.allowTag }}
{{- printf "%s:%s" $i.repository $i.tag }}
{{- else }}
{{- fail (printf "redis.image.digest is empty: the chart pins Redis by digest. Set redis.image.digest to the sha256 digest of %s:%s (`docker buildx imagetools inspect %s:%s` or `crane digest %s:%s`), or redis.image.allowTag=true to pull by tag." $i.repository $i.tag $i.repository $i.tag $i.repository $i.tag) }}
{{- end }}
{{- end }}

{{/* The webhook's own Deployment and Service. */}}
{{- define "breakpod.webhookName" -}}
{{- printf "%s-webhook" (include "breakpod.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/* Whether the webhook certificate comes from cert-manager: asked for, and the
cluster serves its API (helm template: --api-versions cert-manager.io/v1). */}}
{{- define "breakpod.webhookCertManager" -}}
{{- if and .Values.webhook.tls.certManager.enabled (.Capabilities.APIVersions.Has "cert-manager.io/v1") }}true{{ end }}
{{- end }}

{{/* The Secret holding the broker's tokens file of per-namespace agent tokens; empty: none. */}}
{{- define "breakpod.agentTokensFile" -}}
{{- if .Values.agentTokens.existingSecret }}
{{- .Values.agentTokens.existingSecret }}
{{- else if .Values.agentTokens.namespaces }}
{{- printf "%s-agent-tokens" (include "breakpod.fullname" . | trunc 50 | trimSuffix "-") }}
{{- end }}
{{- end }}

{{/* The namespaces a namespaced feature's Role goes in: the list, or the release's. */}}
{{- define "breakpod.namespacesOr" -}}
{{- toJson (.list | default (list .root.Release.Namespace)) }}
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
{{- printf "%s-tls" (include "breakpod.webhookName" .) }}
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
{{- $_ := include "breakpod.image" . }}
{{- if $v.redis.enabled }}{{ $_ = include "breakpod.redisImage" . }}{{ end }}
{{- $cm := .Capabilities.APIVersions.Has "cert-manager.io/v1" }}
{{- if and $v.webhook.enabled $v.webhook.tls.certManager.enabled (not $cm) (not $v.webhook.tls.selfSignedFallback) }}
{{- fail "webhook.tls.certManager.enabled is true but this cluster does not serve cert-manager.io/v1 (cert-manager is not installed) and webhook.tls.selfSignedFallback is false. Install cert-manager, set webhook.tls.selfSignedFallback=true, or give webhook.tls.secretName and caBundle with certManager.enabled=false." }}
{{- end }}
{{- if and $v.broker.tls.enabled $v.broker.tls.certManager.enabled (not $cm) }}
{{- fail "broker.tls.certManager.enabled is true but this cluster does not serve cert-manager.io/v1 (cert-manager is not installed; `helm template` needs --api-versions cert-manager.io/v1). Install cert-manager, or set broker.tls.secretName with broker.tls.certManager.enabled=false." }}
{{- end }}
{{- if and $v.ingress.enabled (not $v.ingress.host) }}
{{- fail "ingress.enabled is true but ingress.host is empty: set the host name the Ingress serves." }}
{{- end }}
{{- if and $v.ingress.enabled (not $v.broker.trustedProxies) }}
{{- fail "ingress.enabled is true but broker.trustedProxies is empty: behind the Ingress the broker would take the controller for the client and leave the dashboard cookie without Secure. Set broker.trustedProxies to the Ingress controller pods' CIDR." }}
{{- end }}
{{- if and $v.redis.password $v.redis.existingSecret }}
{{- fail "redis.password and redis.existingSecret are both set: pick one (the Secret is preferred)." }}
{{- end }}
{{- if and $v.redis.password (not $v.redis.enabled) }}
{{- fail "redis.password is set while redis.enabled is false: it is the in-release Redis password. Put an external Redis password in a Secret (redis.urlSecret)." }}
{{- end }}
{{- if and $v.agentTokens.existingSecret (or $v.agentTokens.namespaces $v.agentTokens.tokens) }}
{{- fail "agentTokens.existingSecret is set together with agentTokens.namespaces/tokens: with the Secret, the chart writes no token into the training namespaces. Pick one." }}
{{- end }}
{{- if and $v.agentTokens.namespaces (not $v.overlay.tokenSecret.name) }}
{{- fail "agentTokens.namespaces is set but overlay.tokenSecret.name is empty: the chart writes each namespace's token into that Secret. Set overlay.tokenSecret.name." }}
{{- end }}
{{- range $ns, $_ := $v.agentTokens.tokens }}
{{- if not (has $ns $v.agentTokens.namespaces) }}
{{- fail (printf "agentTokens.tokens has a token for %s, which is not in agentTokens.namespaces: add the namespace, or drop the token." $ns) }}
{{- end }}
{{- end }}
{{- if and $v.serviceMonitor.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") $v.auth.existingSecret (not $v.serviceMonitor.tokenSecret.name) }}
{{- fail "serviceMonitor.tokenSecret.name is empty while auth.existingSecret is set: Prometheus needs a Secret holding a bare viewer token. Set serviceMonitor.tokenSecret.name (and .key), or serviceMonitor.enabled=false." }}
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

{{/* The external Redis's port, from redis.url; 6379 when it names none or sits in urlSecret. */}}
{{- define "breakpod.externalRedisPort" -}}
{{- $m := regexFind "^rediss?://[^/]*:[0-9]+" .Values.redis.url }}
{{- if $m }}{{ regexReplaceAll "^.*:" $m "" }}{{ else }}6379{{ end }}
{{- end }}
