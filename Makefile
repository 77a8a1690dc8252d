.PHONY: test setup docs demo bench

setup:
	bash scripts/setup_env.sh

test:
	bash scripts/test.sh

docs: setup
	.venv/bin/mkdocs build --strict
