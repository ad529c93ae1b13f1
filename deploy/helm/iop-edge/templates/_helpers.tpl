{{/*
Names, labels and the few computations every template shares. The names the operator looks up
(the EdgeConfig's NAME-edge ConfigMap, NAME-edge-admin Secret, the iop.dev/* labels) follow
docs/operator.md, "The contract with the Helm chart".
*/}}

{{- define "iop-edge.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "iop-edge.fullname" -}}
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

{{- define "iop-edge.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* A resource name under the release prefix: (list $ "suffix"). */}}
{{- define "iop-edge.component-name" -}}
{{- $root := index . 0 }}
{{- printf "%s-%s" (include "iop-edge.fullname" $root) (index . 1) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Cluster-scoped objects (the webhook configuration, the ClusterRole for it) are shared by every
namespace, so their names carry the release's namespace too.
*/}}
{{- define "iop-edge.cluster-name" -}}
{{- printf "%s-%s" (include "iop-edge.fullname" .) .Release.Namespace | trunc 253 | trimSuffix "-" }}
{{- end }}

{{/* The EdgeConfig's name: every operator-side name derives from it. */}}
{{- define "iop-edge.edgeconfig-name" -}}
{{- default (include "iop-edge.fullname" .) .Values.edgeConfig.name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "iop-edge.edge-configmap" -}}
{{- printf "%s-edge" (include "iop-edge.edgeconfig-name" .) }}
{{- end }}

{{- define "iop-edge.admin-secret" -}}
{{- printf "%s-edge-admin" (include "iop-edge.edgeconfig-name" .) }}
{{- end }}

{{- define "iop-edge.selector-labels" -}}
app.kubernetes.io/name: {{ include "iop-edge.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "iop-edge.labels" -}}
helm.sh/chart: {{ include "iop-edge.chart" . }}
{{ include "iop-edge.selector-labels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: iop-edge
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of one component: (list $ "edge"). */}}
{{- define "iop-edge.component-labels" -}}
{{- $root := index . 0 }}
{{ include "iop-edge.labels" $root }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* Selector of one component: (list $ "edge"). */}}
{{- define "iop-edge.component-selector" -}}
{{- $root := index . 0 }}
{{ include "iop-edge.selector-labels" $root }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* The operator finds the Edge and Node workloads and their pods by these (conventions.py). */}}
{{- define "iop-edge.edge-selector" -}}
{{ include "iop-edge.component-selector" (list . "edge") }}
iop.dev/edgeconfig: {{ include "iop-edge.edgeconfig-name" . }}
{{- end }}

{{- define "iop-edge.node-selector" -}}
{{- $root := index . 0 }}
{{ include "iop-edge.component-selector" (list $root "node") }}
iop.dev/edgeconfig: {{ include "iop-edge.edgeconfig-name" $root }}
iop.dev/node-id: {{ index . 1 }}
{{- end }}

{{- define "iop-edge.operator-service-account" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "iop-edge.component-name" (list . "operator")) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "iop-edge.webhook-service" -}}
{{- include "iop-edge.component-name" (list . "operator-webhook") }}
{{- end }}

{{/* The Secret the operator keeps its webhook certificate in (made in the cluster, by it). */}}
{{- define "iop-edge.webhook-secret" -}}
{{- include "iop-edge.component-name" (list . "operator-webhook-tls") }}
{{- end }}

{{- define "iop-edge.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{- define "iop-edge.pod-security" -}}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "iop-edge.container-security" -}}
{{- with .Values.containerSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "iop-edge.node-token-secret" -}}
{{- include "iop-edge.component-name" (list (index . 0) (printf "node-%s" (index . 1))) }}
{{- end }}

{{- define "iop-edge.api-keys-secret" -}}
{{- include "iop-edge.component-name" (list . "api-keys") }}
{{- end }}

{{/*
Where a token lives, as the EdgeConfig's `tokenSecret`: (list $ entry "default secret name"
"default key") -> {"name", "key", "generate"} as JSON. The entry's own `tokenSecret` names the
user's Secret (never generated); otherwise the chart's name, which the operator creates with a
random token (it never changes it afterwards). No template draws a token or computes a hash: a
render is a pure function of the values (Argo CD renders on every sync).
*/}}
{{- define "iop-edge.token-secret" -}}
{{- $entry := index . 1 }}
{{- if $entry.tokenSecret }}
{{- dict "name" $entry.tokenSecret.name "key" (default "token" $entry.tokenSecret.key) "generate" false | toJson }}
{{- else }}
{{- dict "name" (index . 2) "key" (index . 3) "generate" true | toJson }}
{{- end }}
{{- end }}

{{/* A node's token Secret: (list $ node). */}}
{{- define "iop-edge.node-token-ref" -}}
{{- $root := index . 0 }}
{{- $node := index . 1 }}
{{- include "iop-edge.token-secret" (list $root $node (include "iop-edge.node-token-secret" (list $root $node.id)) "token") }}
{{- end }}

{{/* The admin API's token Secret: the user's (edge.adminToken.existingSecret) or NAME-edge-admin. */}}
{{- define "iop-edge.admin-token-ref" -}}
{{- $existing := .Values.edge.adminToken.existingSecret }}
{{- if $existing }}
{{- dict "name" $existing "key" (default "token" .Values.edge.adminToken.key) "generate" false | toJson }}
{{- else }}
{{- dict "name" (include "iop-edge.admin-secret" .) "key" "token" "generate" true | toJson }}
{{- end }}
{{- end }}

{{/* The spec from values, through `tpl`, as a dict. */}}
{{- define "iop-edge.values-spec" -}}
{{- tpl (toYaml (.Values.edgeConfig.spec | default dict)) . }}
{{- end }}

{{/* The nodes of the spec from values, as {"nodes": [...]} JSON. */}}
{{- define "iop-edge.spec-nodes" -}}
{{- $spec := include "iop-edge.values-spec" . | fromYaml }}
{{- dict "nodes" ($spec.nodes | default list) | toJson }}
{{- end }}

{{/*
The EdgeConfig spec as the cluster gets it: the values' spec, the listeners and admin API the
chart wires (the ports of its Services, probes and NetworkPolicy, the admin token file and the
TLS files it mounts), and where every token lives: a `tokenHashSha256` the values give is kept;
any other token is named by its Secret (`tokenSecret`), which the operator reads, hashes into the
Edge's config, and creates with a random token when the chart names it (`generate: true`).
`edge.tls` is the chart's alone: files named there must be mounted, and only the chart mounts
anything into the Edge.
*/}}
{{- define "iop-edge.spec" -}}
{{- $root := . }}
{{- $spec := include "iop-edge.values-spec" . | fromYaml }}
{{- $ports := .Values.edge.ports }}
{{- if hasKey ($spec.edge | default dict) "tls" }}
{{- fail "edgeConfig.spec.edge.tls: the chart sets it from the values tls.* (the Secret it mounts into the Edge); use tls.enabled and tls.secretName instead" }}
{{- end }}
{{- $admin := dict "listen" (printf "0.0.0.0:%v" $ports.admin) "tokenFile" "/etc/iop/admin/token" "tokenSecret" (include "iop-edge.admin-token-ref" . | fromJson) }}
{{- $edge := mergeOverwrite (dict) ($spec.edge | default dict) (dict
      "listen" (printf "0.0.0.0:%v" $ports.hub)
      "admin" $admin
      "metrics" (dict "listen" (printf "0.0.0.0:%v" $ports.metrics))) }}
{{- with (include "iop-edge.edge-tls" . | fromYaml) }}
{{- $_ := set $edge "tls" . }}
{{- end }}
{{- $openai := mergeOverwrite (dict) ($spec.openai | default dict) (dict "listen" (printf "0.0.0.0:%v" $ports.openai)) }}
{{- if and .Values.limitStore.redis.enabled (not ($openai.limitStore | default dict).url) }}
{{- $store := mergeOverwrite (dict) ($openai.limitStore | default dict) (dict "url" (printf "redis://%s:%v" (include "iop-edge.component-name" (list . "redis")) .Values.limitStore.redis.port)) }}
{{- $_ := set $openai "limitStore" $store }}
{{- end }}
{{- $tokens := list }}
{{- range ($openai.principalTokens | default list) }}
{{- $entry := omit . "tokenSecret" }}
{{- if not .tokenHashSha256 }}
{{- $_ := set $entry "tokenSecret" (include "iop-edge.token-secret" (list $root . (include "iop-edge.api-keys-secret" $root) .tokenRef) | fromJson) }}
{{- end }}
{{- $tokens = append $tokens $entry }}
{{- end }}
{{- if $openai.principalTokens }}
{{- $_ := set $openai "principalTokens" $tokens }}
{{- end }}
{{- $nodes := list }}
{{- range ($spec.nodes | default list) }}
{{- $node := omit . "tokenSecret" }}
{{- if and (not .tokenHashSha256) (ne (.placement | default "node") "edge") }}
{{- $_ := set $node "tokenSecret" (include "iop-edge.node-token-ref" (list $root .) | fromJson) }}
{{- end }}
{{- $nodes = append $nodes $node }}
{{- end }}
{{- $out := omit $spec "edge" "openai" "nodes" }}
{{- $_ := set $out "edge" $edge }}
{{- $_ := set $out "openai" $openai }}
{{- if $spec.nodes }}
{{- $_ := set $out "nodes" $nodes }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/*
TLS on the Node link. The values are checked here, where every template that mounts or names the
files comes through, so a half-made setting fails the install with what is missing.
*/}}
{{- define "iop-edge.tls-enabled" -}}
{{- $tls := .Values.tls }}
{{- if and $tls.mutual (not $tls.enabled) }}
{{- fail "tls.mutual: needs tls.enabled (mutual TLS is TLS with client certificates)" }}
{{- end }}
{{- if $tls.enabled }}
{{- if and (not $tls.secretName) (not .Values.operator.enabled) }}
{{- fail "tls.secretName: with operator.enabled=false nothing makes the hub's certificates; name a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt (README.md, \"TLS on the Node link\"), or set tls.enabled=false" }}
{{- end }}
{{- if and $tls.clientSecretName (not $tls.secretName) }}
{{- fail "tls.clientSecretName: needs tls.secretName (the generated CA signs only the client certificate it makes itself)" }}
{{- end }}
{{- if and $tls.mutual $tls.secretName (not $tls.clientSecretName) }}
{{- fail "tls.clientSecretName: tls.mutual needs a kubernetes.io/tls Secret with the Nodes' client certificate (tls.crt, tls.key)" }}
{{- end }}
{{- true }}
{{- end }}
{{- end }}

{{/*
The hub's certificates are generated unless the values name a Secret: by the operator, at its
start (`--hub-tls-secret`), into FULLNAME-hub-tls, not by this render. A CA made by a template
would be drawn anew on every render (Argo CD renders on every sync) unless it were read back
from the cluster, which `helm template` and GitOps tools cannot; the operator writes the Secret
once, where `helm upgrade` never touches it, and the pods wait for it as for their tokens.
*/}}
{{- define "iop-edge.tls-generated" -}}
{{- if and (include "iop-edge.tls-enabled" .) (not .Values.tls.secretName) }}{{ true }}{{ end }}
{{- end }}

{{/* The Secret of the Edge's certificate and key and of the CA (ca.crt). */}}
{{- define "iop-edge.tls-secret" -}}
{{- default (include "iop-edge.component-name" (list . "hub-tls")) .Values.tls.secretName }}
{{- end }}

{{/* The Nodes' client certificate: {"name", "crt", "key"} as JSON (mutual TLS). */}}
{{- define "iop-edge.tls-client-ref" -}}
{{- if include "iop-edge.tls-generated" . }}
{{- dict "name" (include "iop-edge.tls-secret" .) "crt" "client.crt" "key" "client.key" | toJson }}
{{- else }}
{{- dict "name" .Values.tls.clientSecretName "crt" "tls.crt" "key" "tls.key" | toJson }}
{{- end }}
{{- end }}

{{/* Where the Edge finds its TLS files: the projected config volume, /etc/iop/tls/. */}}
{{- define "iop-edge.edge-tls" -}}
{{- if include "iop-edge.tls-enabled" . }}
certFile: /etc/iop/tls/tls.crt
keyFile: /etc/iop/tls/tls.key
{{- if .Values.tls.mutual }}
clientCaFile: /etc/iop/tls/ca.crt
{{- end }}
{{- end }}
{{- end }}

{{/* The name the Nodes verify in the Edge's certificate: the hub Service's, not the pod IPs. */}}
{{- define "iop-edge.tls-server-name" -}}
{{- default (printf "%s.%s.svc" (include "iop-edge.component-name" (list . "hub")) .Release.Namespace) .Values.tls.serverName }}
{{- end }}

{{/* The model `helm test` asks for. */}}
{{- define "iop-edge.test-model" -}}
{{- if .Values.tests.model }}
{{- .Values.tests.model }}
{{- else }}
{{- $spec := include "iop-edge.values-spec" . | fromYaml }}
{{- $models := $spec.models | default list }}
{{- if $models }}{{ (first $models).id }}{{ end }}
{{- end }}
{{- end }}

{{/*
The Secrets the operator reads (and may create), by name, as {"names": [...]} JSON: the admin
token's, every token Secret the spec from values names (generated or the user's), the in-cluster
nodes' token Secrets, the webhook certificate's, the hub's generated one, and
operator.rbac.extraSecretNames.
*/}}
{{- define "iop-edge.operator-secret-names" -}}
{{- $root := . }}
{{- $names := list (include "iop-edge.admin-token-ref" . | fromJson).name }}
{{- if .Values.operator.webhook.enabled }}
{{- $names = append $names (include "iop-edge.webhook-secret" .) }}
{{- end }}
{{- if include "iop-edge.tls-generated" . }}
{{- $names = append $names (include "iop-edge.tls-secret" .) }}
{{- end }}
{{- if .Values.edgeConfig.create }}
{{- $spec := include "iop-edge.spec" . | fromYaml }}
{{- range (($spec.openai | default dict).principalTokens | default list) }}
{{- with .tokenSecret }}{{ $names = append $names .name }}{{ end }}
{{- end }}
{{- range ($spec.nodes | default list) }}
{{- with .tokenSecret }}{{ $names = append $names .name }}{{ end }}
{{- end }}
{{- end }}
{{- range .Values.nodes }}
{{- $names = append $names (include "iop-edge.node-token-ref" (list $root .) | fromJson).name }}
{{- end }}
{{- dict "names" (concat $names .Values.operator.rbac.extraSecretNames | uniq) | toJson }}
{{- end }}

{{/* The Deployments the operator may stamp (roll), by name, as {"names": [...]} JSON. */}}
{{- define "iop-edge.operator-deployment-names" -}}
{{- $root := . }}
{{- $names := list (include "iop-edge.component-name" (list . "edge")) }}
{{- range .Values.nodes }}
{{- $names = append $names (include "iop-edge.component-name" (list $root (printf "node-%s" .id))) }}
{{- end }}
{{- dict "names" (concat $names .Values.operator.rbac.extraDeploymentNames | uniq) | toJson }}
{{- end }}

{{/*
The upstream policy of one workload, as JSON (IOP_UPSTREAM_POLICY; docs/operator.md, "Who may do
what"): `upstreams.allow` (with the chart's fake upstream when it runs), `upstreams.deny`, and the
key bindings of the `apiKeys` entries given (each names its `hosts`, and may name `providers`).
Called with (list $root $apiKeys).
*/}}
{{- define "iop-edge.upstream-policy" -}}
{{- $root := index . 0 }}
{{- $allow := list }}
{{- range $root.Values.upstreams.allow }}
{{- $allow = append $allow . }}
{{- end }}
{{- if $root.Values.fakeUpstream.enabled }}
{{- $name := include "iop-edge.component-name" (list $root "fake-upstream") }}
{{- $port := $root.Values.fakeUpstream.port }}
{{- range (list $name (printf "%s.%s" $name $root.Release.Namespace) (printf "%s.%s.svc" $name $root.Release.Namespace) (printf "%s.%s.svc.cluster.local" $name $root.Release.Namespace)) }}
{{- $allow = append $allow (printf "%s:%v" . $port) }}
{{- end }}
{{- end }}
{{- $keys := list }}
{{- range (index . 1 | default list) }}
{{- $key := . }}
{{- if not $key.hosts }}
{{- fail (printf "apiKeys entry %s: name the hosts its key may be sent to (hosts: [name:port, ...]): a key with no hosts is never read (docs/operator.md, \"Who may do what\")" $key.env) }}
{{- end }}
{{- $keys = append $keys (dict "env" $key.env "hosts" $key.hosts "providers" ($key.providers | default list)) }}
{{- end }}
{{- dict "allow" $allow "deny" ($root.Values.upstreams.deny | default list) "keys" $keys | toJson }}
{{- end }}

{{/* Every API key binding of the release (the Edge's, each Node's, `upstreams.keys`): what the
operator's webhook checks a config's `apiKeyEnv` against. */}}
{{- define "iop-edge.all-api-keys" -}}
{{- $all := concat (.Values.edge.apiKeys | default list) (.Values.upstreams.keys | default list) }}
{{- range .Values.nodes }}
{{- $all = concat $all (.apiKeys | default list) }}
{{- end }}
{{- dict "keys" $all | toJson }}
{{- end }}

{{- /* The OTEL_* variables of a container of `service` (iop-edge, iop-node) when tracing is on:
the SDK reads them (docs/edge.md, "Traces"). Arguments: (list $ service). */}}
{{- define "iop-edge.tracing-env" -}}
{{- $root := index . 0 }}
{{- $service := index . 1 }}
{{- with $root.Values.tracing }}
{{- if .enabled }}
{{- $endpoint := .endpoint }}
{{- if and (not $endpoint) $root.Values.fakeCollector.enabled }}
{{- $endpoint = printf "http://%s:%v" (include "iop-edge.component-name" (list $root "fake-collector")) $root.Values.fakeCollector.otlpPort }}
{{- end }}
{{- if not $endpoint }}
{{- fail "tracing.enabled needs tracing.endpoint (your collector's OTLP/gRPC address) or fakeCollector.enabled" }}
{{- end }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ .insecure | toString | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ $service | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=%s,service.namespace=%s" $root.Release.Namespace $root.Release.Name | quote }}
{{- end }}
{{- end }}
{{- end }}
