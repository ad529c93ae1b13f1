"""Checking tools built from pinned Go modules (e2e/tools/README.md): kubeconform and its schemas
(`chartcheck`), kstatus and the Argo CD health check (`healthcheck`), both built by `gotools`
into the local cluster's binary cache. Standard library only at import, like e2e.cluster.
"""
