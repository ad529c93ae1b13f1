# The commands a newcomer needs (see README.md); each installs what it needs first.
.PHONY: run run-local stop test kind-test

run:        ## the product in Kubernetes: local cluster, helm install, Ready, what to type (Ctrl-C stops)
	scripts/run

run-local:  ## the quick mode without Kubernetes: `iop up` on configs/edge.yaml
	scripts/run-local

stop:       ## tear down what `make run` started
	scripts/stop

test:       ## every check and test (what CI runs)
	scripts/test

kind-test:  ## on a host with Docker: kind cluster, image, chart, the e2e suite (e2e/kind/README.md)
	e2e/kind/run
