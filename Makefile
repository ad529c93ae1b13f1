# The two commands a newcomer needs (see README.md); both install what they need first.
.PHONY: run test

run:  ## install everything and run the product on configs/edge.yaml
	scripts/run

test: ## install everything and run every check and test (what CI runs)
	scripts/test
