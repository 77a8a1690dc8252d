.PHONY: test setup docs demo

setup:
	bash scripts/setup_env.sh

test:
	bash scripts/test.sh

docs: setup
	.venv/bin/mkdocs build --strict

# The main job: prepare the offline corpus and train the `hetero` preset on a small GPT (CPU, minutes).
demo: setup
	.venv/bin/geomtrain prepare
	.venv/bin/geomtrain train --model mini --preset hetero --out-dir runs/demo-hetero
