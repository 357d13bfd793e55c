{{/* Full name of the release's objects: the release name, or <release>-disagg-operator. */}}
{{- define "disagg-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "disagg-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "disagg-operator.labels" -}}
{{ include "disagg-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "disagg-operator.serviceAccountName" -}}
{{- default (include "disagg-operator.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "disagg-operator.peeringName" -}}
{{- default (include "disagg-operator.fullname" .) .Values.peering.name -}}
{{- end -}}

{{- define "disagg-operator.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The generated RBAC rules (files/rules.yaml, from `disagg-operator rbac`): "cluster" or "namespaced". */}}
{{- define "disagg-operator.rules" -}}
{{- $all := .context.Files.Get "files/rules.yaml" | fromYaml -}}
{{- index $all .scope | toYaml -}}
{{- end -}}
