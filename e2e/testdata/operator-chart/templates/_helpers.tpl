{{- define "e2e.labels" -}}
iop.dev/edgeconfig: {{ .Values.edgeConfigName }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "e2e.kwok" -}}
{{- if .Values.kwok }}
nodeSelector: {type: kwok}
tolerations:
  - {key: kwok.x-k8s.io/node, operator: Exists, effect: NoSchedule}
{{- end }}
{{- end }}
