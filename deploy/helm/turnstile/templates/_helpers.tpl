{{- define "turnstile.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "turnstile.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "turnstile.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The environment variable a tenant's token or a provider's key arrives in: the name made
     a variable name, then a digest of the exact name, so `acme-eu` and `acme_eu` never share
     one variable (and so one token). */}}
{{- define "turnstile.envName" -}}
{{- printf "%s_%s_%s" .prefix (.name | upper | replace "-" "_" | replace "." "_") (.name | sha256sum | trunc 8) -}}
{{- end -}}
