"""A real, local Kubernetes cluster whose pods really run (e2e/cluster/README.md).

`localcluster` is the command line (`build`, `up`, `image`, `down`, `status`, `pin`; the
executables beside it call it) and its parts are the modules beside it; `kubelet` is the process
kubelet, a package of its own that the cluster starts in the checkout's virtualenv. Everything
but the kubelet is standard library only, so any python3 >= 3.11 runs it: this package imports
nothing, so that importing one part loads only what that part needs.
"""
