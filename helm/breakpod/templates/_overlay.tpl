{{/*
The debug overlay for training pods: the ONE place it is defined. Rendered
from values into a document {pod: {...}, container: {...}} that is
  * merged by the named templates below into the user's own pod spec, and
  * shipped (overlay-configmap.yaml) to the admission webhook, which merges it
    with the same rules (broker/src/breakpod_broker/overlay.py):
      null -> remove the key; a list of {name: ...} -> merge by name
      (replace in place, append new); anything else -> set; except that a
      pod's own runtimeClassName is never replaced.
Works from a parent chart (dependency named "breakpod") as well as here.
*/}}
{{- define "breakpod.values" -}}
{{- if hasKey .Values "breakpod" }}{{ toJson .Values.breakpod }}{{ else }}{{ toJson .Values }}{{ end }}
{{- end }}

{{- define "breakpod.overlay" -}}
{{- $v := include "breakpod.values" . | fromJson }}
{{- $o := $v.overlay }}
{{- $ctx := dict "Values" $v "Release" .Release "Chart" (dict "Name" "breakpod") }}
{{- $scheme := ternary "https" "http" (and $v.broker.tls $v.broker.tls.enabled | default false) }}
{{- if and (eq $v.install false) (not $o.brokerUrl) }}
{{- fail "breakpod.install is false, so this release has no broker: set breakpod.overlay.brokerUrl to the broker your pods report to." }}
{{- end }}
{{- $url := $o.brokerUrl | default (printf "%s://%s.%s.svc:%v" $scheme (include "breakpod.fullname" $ctx) .Release.Namespace $v.service.port) }}
pod:
  {{- if $o.runtimeClassName }}
  runtimeClassName: {{ $o.runtimeClassName | quote }}
  {{- else }} {}
  {{- end }}
container:
  tty: {{ $o.tty }}
  stdin: {{ $o.stdin }}
  {{- if eq $o.livenessProbe "remove" }}
  livenessProbe: null
  {{- end }}
  ports:
    - name: {{ $o.portName | quote }}
      containerPort: {{ int $o.port }}
      protocol: TCP
  env:
    - name: ENABLE_REMOTE_DEBUG
      value: "1"
    - name: PYTHONBREAKPOINT
      value: breakpod.set_trace
    - name: BREAKPOD_HOST
      value: {{ $o.listenHost | quote }}
    - name: BREAKPOD_PORT
      value: {{ int $o.port | quote }}
    - name: BREAKPOD_BROKER_URL
      value: {{ $url | quote }}
    {{- if and $v.broker.tls $v.broker.tls.enabled $v.broker.tls.caConfigMap }}
    - name: BREAKPOD_BROKER_CA
      valueFrom:
        configMapKeyRef: {name: {{ $v.broker.tls.caConfigMap | quote }}, key: ca.crt, optional: true}
    {{- end }}
    {{- with $o.tokenSecret.name }}
    - name: BREAKPOD_AGENT_TOKEN
      valueFrom:
        secretKeyRef: {name: {{ . | quote }}, key: {{ $o.tokenSecret.key | quote }}, optional: true}
    {{- if not (has $o.listenHost (list "127.0.0.1" "localhost" "::1")) }}
    {{- /* a listener off loopback needs a token; the chart has one Secret for the pod */}}
    - name: BREAKPOD_LISTENER_TOKEN
      valueFrom:
        secretKeyRef: {name: {{ . | quote }}, key: {{ $o.tokenSecret.key | quote }}, optional: true}
    {{- end }}
    {{- end }}
    - name: BREAKPOD_POST_MORTEM
      value: {{ ternary "1" "0" $o.postMortem | quote }}
    {{- if $o.disableCompile }}
    - name: TORCH_COMPILE_DISABLE
      value: "1"
    {{- end }}
    - name: POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - name: POD_NAMESPACE
      valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
    - name: NODE_NAME
      valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
    {{- with $o.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* (dict "target" MAP "patch" MAP) -> JSON of the merged map. */}}
{{- define "breakpod.merge" -}}
{{- $out := deepCopy (.target | default dict) }}
{{- range $key, $value := (.patch | default dict) }}
{{- if kindIs "invalid" $value }}
{{- $_ := unset $out $key }}
{{- else if and (kindIs "slice" $value) (include "breakpod.named" $value) }}
{{- $merged := include "breakpod.mergeNamed" (dict "current" (get $out $key | default list) "items" $value) | fromJsonArray }}
{{- $_ := set $out $key $merged }}
{{- else }}
{{- $_ := set $out $key $value }}
{{- end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* "true" when every item of a list is a map with a name. */}}
{{- define "breakpod.named" -}}
{{- $ok := true }}
{{- range . }}{{ if not (and (kindIs "map" .) (hasKey . "name")) }}{{ $ok = false }}{{ end }}{{ end }}
{{- if $ok }}true{{ end }}
{{- end }}

{{/* (dict "current" LIST "items" LIST) -> JSON list merged by item name. */}}
{{- define "breakpod.mergeNamed" -}}
{{- $new := dict }}
{{- range .items }}{{ $_ := set $new .name . }}{{ end }}
{{- $seen := dict }}
{{- $out := list }}
{{- range .current }}
{{- if and (kindIs "map" .) (hasKey . "name") }}
{{- $_ := set $seen .name true }}
{{- $out = append $out (get $new .name | default .) }}
{{- else }}
{{- $out = append $out . }}
{{- end }}
{{- end }}
{{- range .items }}{{ if not (hasKey $seen .name) }}{{ $out = append $out . }}{{ end }}{{ end }}
{{- toJson $out }}
{{- end }}

{{/* (dict "spec" POD_SPEC "overlay" OVERLAY "container" NAME) -> JSON of the debugged pod spec. */}}
{{- define "breakpod.applyPod" -}}
{{- include "breakpod.portsFree" . }}
{{- $pod := deepCopy (.overlay.pod | default dict) }}
{{- if .spec.runtimeClassName }}{{ $_ := unset $pod "runtimeClassName" }}{{ end }}
{{- $out := include "breakpod.merge" (dict "target" .spec "patch" $pod) | fromJson }}
{{- $index := 0 }}
{{- if .container }}
{{- $index = -1 }}
{{- range $i, $c := $out.containers }}{{ if eq $c.name $.container }}{{ $index = $i }}{{ end }}{{ end }}
{{- if lt $index 0 }}
{{- fail (printf "breakpod.debugPod: container %q is not in the pod spec" .container) }}
{{- end }}
{{- end }}
{{- $containers := list }}
{{- range $i, $c := $out.containers }}
{{- if eq $i $index }}
{{- $c = include "breakpod.merge" (dict "target" $c "patch" $.overlay.container) | fromJson }}
{{- end }}
{{- $containers = append $containers $c }}
{{- end }}
{{- $_ := set $out "containers" $containers }}
{{- toJson $out }}
{{- end }}

{{/* Fails when the pod already uses the overlay's debug port under another name
(the webhook moves it; a template cannot, and says which value to change). */}}
{{- define "breakpod.portsFree" -}}
{{- $ours := list }}
{{- range (.overlay.container.ports | default list) }}{{ $ours = append $ours .name }}{{ end }}
{{- range $c := concat (.spec.initContainers | default list) (.spec.containers | default list) }}
{{- range $used := ($c.ports | default list) }}
{{- range $.overlay.container.ports | default list }}
{{- if and (eq (int .containerPort) (int $used.containerPort)) (not (has $used.name $ours)) }}
{{- fail (printf "breakpod.debugPod: port %v is in use in this pod (container %v): set breakpod.overlay.port to a free one" (int .containerPort) $c.name) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Pod level. Two forms:
  {{ include "breakpod.debugPod" . }}                         -> runtimeClassName line(s) to put in your pod spec
  {{ include "breakpod.debugPod" (dict "root" . "spec" $spec "container" "train") }}
                                                             -> your whole pod spec, debugged ("container":
                                                                which one; default the first), exactly as the
                                                                admission webhook would mutate it
*/}}
{{- define "breakpod.debugPod" -}}
{{- if hasKey . "spec" }}
{{- $overlay := include "breakpod.overlay" .root | fromYaml }}
{{- include "breakpod.applyPod" (dict "spec" .spec "overlay" $overlay "container" .container) | fromJson | toYaml }}
{{- else }}
{{- $overlay := include "breakpod.overlay" . | fromYaml }}
{{- with $overlay.pod }}{{ toYaml . }}{{ end }}
{{- end }}
{{- end }}

{{/*
Container level. Two forms:
  {{ include "breakpod.debugContainer" . }}                   -> tty, stdin, env, ports lines for a container
                                                                that has no env/ports/livenessProbe of its own
  {{ include "breakpod.debugContainer" (dict "root" . "container" $c) }}
                                                             -> your container, merged with the overlay
*/}}
{{- define "breakpod.debugContainer" -}}
{{- if hasKey . "container" }}
{{- $overlay := include "breakpod.overlay" .root | fromYaml }}
{{- include "breakpod.merge" (dict "target" .container "patch" $overlay.container) | fromJson | toYaml }}
{{- else }}
{{- $overlay := include "breakpod.overlay" . | fromYaml }}
{{- $fields := dict }}
{{- range $k, $v := $overlay.container }}{{ if not (kindIs "invalid" $v) }}{{ $_ := set $fields $k $v }}{{ end }}{{ end }}
{{- toYaml $fields }}
{{- end }}
{{- end }}
