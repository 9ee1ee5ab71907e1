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

{{/* The MLflow Service's name, and the Host headers the server accepts (--allowed-hosts): the Service's own
names with and without the port, localhost for `kubectl port-forward`, and mlflow.allowedHosts. */}}
{{- define "kubealign.mlflowService" -}}
{{- printf "%s-mlflow" (include "kubealign.fullname" .) -}}
{{- end -}}

{{- define "kubealign.mlflowAllowedHosts" -}}
{{- if has "*" .Values.mlflow.allowedHosts -}}
*
{{- else -}}
{{- $svc := include "kubealign.mlflowService" . -}}
{{- $hosts := list -}}
{{- range list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) -}}
{{- $hosts = concat $hosts (list . (printf "%s:%d" . (int $.Values.mlflow.port))) -}}
{{- end -}}
{{- $hosts = concat $hosts (list "localhost:*" "127.0.0.1:*") .Values.mlflow.allowedHosts -}}
{{- join "," $hosts -}}
{{- end -}}
{{- end -}}

{{/* The Secrets of the four identities of the authenticated registry: the user's own, or the chart's. */}}
{{- define "kubealign.mlflowAdminSecret" -}}
{{- .Values.mlflow.auth.adminSecret | default (printf "%s-mlflow-admin" (include "kubealign.fullname" .)) -}}
{{- end -}}

{{- define "kubealign.mlflowPipelineSecret" -}}
{{- .Values.mlflow.auth.pipelineSecret | default (printf "%s-mlflow" (include "kubealign.fullname" .)) -}}
{{- end -}}

{{- define "kubealign.mlflowTrackerSecret" -}}
{{- .Values.mlflow.auth.trackerSecret | default (printf "%s-mlflow-tracker" (include "kubealign.fullname" .)) -}}
{{- end -}}

{{- define "kubealign.mlflowReaderSecret" -}}
{{- .Values.mlflow.auth.readerSecret | default (printf "%s-mlflow-reader" (include "kubealign.fullname" .)) -}}
{{- end -}}

{{- define "kubealign.mlflowAuth" -}}
{{- if and .Values.mlflow.enabled .Values.mlflow.auth.enabled -}}true{{- end -}}
{{- end -}}

{{/* MLFLOW_AUTH_DATABASE_URI: the users database of the basic-auth app, beside the tracking store. */}}
{{- define "kubealign.mlflowAuthDatabaseEnv" -}}
- name: MLFLOW_AUTH_DATABASE_URI
{{- if eq .Values.mlflow.backendStore.type "postgresql" }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.mlflow.backendStore.existingSecret }}
      key: {{ .Values.mlflow.auth.databaseSecretKey | default .Values.mlflow.backendStore.secretKey }}
{{- else }}
  value: sqlite:////data/basic_auth.db
{{- end }}
{{- end -}}
