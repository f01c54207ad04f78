{{/* Names, labels and shared pieces of the pdserve chart. */}}

{{/* The chart name, or nameOverride. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-pdserve" (or the release name when it already holds the chart name). Kept to 40
characters: KubeRay derives longer names (e.g. "<cluster>-head-svc") from the RayCluster's. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "pdserve-0.1.0" for the helm.sh/chart label. */}}
{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{/* Labels that select the release's pods. */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selector labels of the coordinator pod and Service. */}}
{{- define "pdserve.coordinatorSelectorLabels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/component: coordinator
{{- end }}

{{/* The image reference, tag defaulting to appVersion. */}}
{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Name of the RayCluster; KubeRay names its head Service "<this>-head-svc". */}}
{{- define "pdserve.rayClusterName" -}}
{{- printf "%s-ray" (include "pdserve.fullname" .) }}
{{- end }}

{{/* The address ray.init(address=...) gets: the head's GCS, "HOST:6379". */}}
{{- define "pdserve.rayAddress" -}}
{{- if .Values.msCoordinator.backend_config.ray_address }}
{{- .Values.msCoordinator.backend_config.ray_address }}
{{- else }}
{{- printf "%s-head-svc.%s.svc:6379" (include "pdserve.rayClusterName" .) .Release.Namespace }}
{{- end }}
{{- end }}

{{/* Name of the TLS Secret. */}}
{{- define "pdserve.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "pdserve.fullname" .)) .Values.tls.secretName }}
{{- end }}

{{/* Where the TLS Secret is mounted in the coordinator. */}}
{{- define "pdserve.tlsDir" -}}/etc/pdserve/tls{{- end }}

{{/* Whether tls_config.ca_cert is set (ca.crt in the Secret). */}}
{{- define "pdserve.tlsCaCert" -}}
{{- if and .Values.tls.enabled (or .Values.tls.selfSigned .Values.tls.caCert) }}true{{ end }}
{{- end }}

{{/* ms_coordinator.json: the msCoordinator sections plus what the chart manages (tls_config,
backend_config.ray_address). */}}
{{- define "pdserve.msCoordinatorJson" -}}
{{- $config := deepCopy .Values.msCoordinator }}
{{- $_ := set $config.backend_config "ray_address" (include "pdserve.rayAddress" .) }}
{{- /* Decode pods advertise their pod IP for the KV hand-off; each role's actors ask for their
      group's custom resource, so prefill actors land on prefill pods and decode on decode. */}}
{{- if not (hasKey $config.backend_config "kv_host") }}
{{- $_ := set $config.backend_config "kv_host" "auto" }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- $key := printf "%s_resources" $role }}
{{- if not (hasKey $config.backend_config $key) }}
{{- $group := index $.Values $role }}
{{- $cpu := toString $group.resources.cpu }}
{{- $cpus := ternary (divf (trimSuffix "m" $cpu | float64) 1000) ($cpu | float64) (hasSuffix "m" $cpu) }}
{{- $name := printf "pdserve_%s" $role }}
{{- $custom := dict }}
{{- if index ($group.rayResources | default dict) $name }}
{{- $custom = dict $name 1 }}
{{- end }}
{{- $_ := set $config.backend_config $key (dict "num_cpus" $cpus "num_gpus" (int $group.resources.gpu) "resources" $custom) }}
{{- end }}
{{- end }}
{{- $tls := dict "request_server_tls_enable" .Values.tls.enabled }}
{{- if .Values.tls.enabled }}
{{- $dir := include "pdserve.tlsDir" . }}
{{- $_ := set $tls "tls_cert" (printf "%s/tls.crt" $dir) }}
{{- $_ := set $tls "tls_key" (printf "%s/tls.key" $dir) }}
{{- if include "pdserve.tlsCaCert" . }}
{{- $_ := set $tls "ca_cert" (printf "%s/ca.crt" $dir) }}
{{- end }}
{{- end }}
{{- $_ := set $config "tls_config" $tls }}
{{- toPrettyJson $config }}
{{- end }}

{{/* Volumes every pod has: the model volume (when model.type is not none). */}}
{{- define "pdserve.modelVolume" -}}
{{- if eq .Values.model.type "persistentVolumeClaim" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.claimName is required when model.type is persistentVolumeClaim" .Values.model.claimName }}
    readOnly: {{ .Values.model.readOnly }}
{{- else if eq .Values.model.type "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath is required when model.type is hostPath" .Values.model.hostPath }}
    type: Directory
{{- end }}
{{- end }}

{{/* The model volume's mount. */}}
{{- define "pdserve.modelVolumeMount" -}}
{{- if ne .Values.model.type "none" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ .Values.model.readOnly }}
{{- end }}
{{- end }}

{{/* Container resources from {cpu, memory, gpu}: requests = limits. Argument: (list $ $res). */}}
{{- define "pdserve.rayResources" -}}
{{- $root := index . 0 }}
{{- $res := index . 1 }}
{{- $amounts := dict "cpu" (toString $res.cpu) "memory" (toString $res.memory) }}
{{- if gt (int $res.gpu) 0 }}
{{- $_ := set $amounts $root.Values.ray.gpuResourceName (int $res.gpu) }}
{{- end -}}
requests:
  {{- toYaml $amounts | nindent 2 }}
limits:
  {{- toYaml $amounts | nindent 2 }}
{{- end }}

{{/* The pod template of a Ray group. Argument: (dict "root" $ "role" "prefill" "group" $values). */}}
{{- define "pdserve.rayPodTemplate" -}}
{{- $root := .root }}
{{- $group := .group -}}
metadata:
  labels:
    {{- include "pdserve.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ printf "ray-%s" .role }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ printf "ray-%s" .role }}
      image: {{ include "pdserve.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- if eq .role "head" }}
      ports:
        - name: gcs-server
          containerPort: 6379
          protocol: TCP
        - name: dashboard
          containerPort: 8265
          protocol: TCP
        - name: client
          containerPort: 10001
          protocol: TCP
        - name: metrics
          containerPort: 8080
          protocol: TCP
      {{- end }}
      resources:
        {{- include "pdserve.rayResources" (list $root $group.resources) | nindent 8 }}
      lifecycle:
        preStop:
          exec:
            command: ["/bin/sh", "-c", "ray stop"]
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
        {{- with include "pdserve.modelVolumeMount" $root }}
        {{- . | nindent 8 }}
        {{- end }}
  volumes:
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $group.shmSize }}
    {{- with include "pdserve.modelVolume" $root }}
    {{- . | nindent 4 }}
    {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* rayStartParams of a worker group: its own plus --resources from rayResources. Ray wants the
JSON quoted for the shell, KubeRay passes the value as is: "{\"pdserve_prefill\": 1000}". */}}
{{- define "pdserve.workerStartParams" -}}
{{- $params := dict }}
{{- range $key, $value := .rayStartParams }}
{{- $_ := set $params $key (toString $value) }}
{{- end }}
{{- if .rayResources }}
{{- $_ := set $params "resources" (printf "\"%s\"" (toJson .rayResources | replace "\"" "\\\"")) }}
{{- end }}
{{- toYaml $params }}
{{- end }}
