{{/* Labels every object of the release carries (Helm's conventions). */}}
{{- define "warmgate.labels" -}}
{{ include "warmgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* The labels the Service and the Deployment select pods by: never change
     them in an upgrade (a Deployment's selector is immutable). */}}
{{- define "warmgate.selectorLabels" -}}
app.kubernetes.io/name: warmgate
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The operator's service account: made by the chart, or one given. */}}
{{- define "warmgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{ default .Release.Name .Values.serviceAccount.name }}
{{- else -}}
{{ required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end -}}
{{- end }}
