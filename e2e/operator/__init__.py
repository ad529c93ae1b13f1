"""The operator against the local cluster: its CRD, webhook, workloads, live and restart edits,
releases and health, as kstatus and Argo CD read it."""
