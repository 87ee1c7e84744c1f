{{/* Base name of the objects: the release name when it contains the chart
name ("kvloop" -> kvloop-agent, kvloop-router), else "<release>-kvloop". */}}
{{- define "kvloop.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvloop.agent.name" -}}{{ include "kvloop.fullname" . }}-agent{{- end -}}
{{- define "kvloop.router.name" -}}{{ include "kvloop.fullname" . }}-router{{- end -}}

{{/* Name of the Secret holding the router admin token (key `token`). */}}
{{- define "kvloop.adminSecret.name" -}}
{{- if .Values.adminToken.existingSecret -}}
{{- .Values.adminToken.existingSecret -}}
{{- else -}}
{{- include "kvloop.router.name" . }}-admin
{{- end -}}
{{- end -}}

{{/* Selector labels; call with (dict "ctx" $ "component" "agent"). */}}
{{- define "kvloop.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvloop.fullname" .ctx }}-{{ .component }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- end -}}

{{/* All labels of an object of a component. */}}
{{- define "kvloop.labels" -}}
{{ include "kvloop.selectorLabels" . }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: kvloop
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Image reference: [registry/]repository:tag. */}}
{{- define "kvloop.image" -}}
{{- $reg := .ctx.Values.image.registry -}}
{{- if $reg -}}{{ $reg }}/{{- end -}}{{ .image.repository }}:{{ .image.tag | default .ctx.Chart.AppVersion }}
{{- end -}}
