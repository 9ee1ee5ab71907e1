{{/* Names and labels shared by the chart's templates. */}}
{{- define "kubealign.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kubealign.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kubealign.mlflowSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: mlflow
{{- end -}}

{{- define "kubealign.tag" -}}
{{- .Values.image.tag | default .Chart.AppVersion -}}
{{- end -}}

{{- define "kubealign.trainImage" -}}
{{- printf "%s/%s:%s" .Values.image.registry .Values.image.train (include "kubealign.tag" .) -}}
{{- end -}}

{{- define "kubealign.cpuImage" -}}
{{- printf "%s/%s:%s" .Values.image.registry .Values.image.cpu (include "kubealign.tag" .) -}}
{{- end -}}

{{- define "kubealign.rbacNamespace" -}}
{{- .Values.rbac.namespace | default .Release.Namespace -}}
{{- end -}}

{{- define "kubealign.mlflowUri" -}}
{{- if .Values.pipelineDefaults.mlflowTrackingUri -}}
{{- .Values.pipelineDefaults.mlflowTrackingUri -}}
{{- else -}}
{{- printf "http://%s-mlflow.%s.svc.cluster.local:%d" (include "kubealign.fullname" .) .Release.Namespace (int .Values.mlflow.port) -}}
{{- end -}}
{{- end -}}

{{- define "kubealign.mlflowNeedsPvc" -}}
{{- if or (eq .Values.mlflow.backendStore.type "sqlite") (eq .Values.mlflow.artifactStore.type "pvc") -}}true{{- end -}}
{{- end -}}
