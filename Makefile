.PHONY: test setup docs demo

setup:
	bash scripts/setup_env.sh

test:
	bash scripts/test.sh

docs: setup
	.venv/bin/mkdocs build --strict

# The main job: prepare the offline corpus (with an 8k BPE vocabulary trained on its train split,
# so the small model's LM head stays cheap on CPU) and train the `hetero` preset for a few minutes.
demo: setup
	.venv/bin/geomtrain prepare --tokenizer bpe8k
	.venv/bin/geomtrain train --model mini --preset hetero --data-dir data/classics-bpe8k \
		--max-iters 150 --warmup-iters 15 --eval-interval 50 --out-dir runs/demo-hetero
