.PHONY: test check setup docs demo

setup:
	bash scripts/setup_env.sh

# Everything, as CI runs it (creates .venv if missing; two pytest workers): before a push.
test:
	bash scripts/test.sh

# The quick tier (lint, format, tests without the slow ones, Hypothesis profile `quick`): before every commit.
# Needs .venv: it says to run `make setup` first when it is missing.
check:
	bash scripts/check.sh

# NO_MKDOCS_2_WARNING: silences mkdocs-material's end-of-life banner (raw ANSI colour codes in a log)
docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

# Torch threads per process: 1 on small CPUs (on 2 busy cores 2 threads ran 3.3x slower than 1),
# half the cores on bigger machines. Override with `make demo THREADS=4`.
THREADS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); if [ $$n -le 4 ]; then echo 1; else echo $$((n / 2)); fi)

# The main job: prepare the offline corpus (with an 8k BPE vocabulary trained on its train split,
# so the small model's LM head stays cheap on CPU) and train the `hetero` preset (about 2 minutes
# on a 2-core CPU). --overwrite: a second `make demo` replaces the first demo run.
demo: setup
	OMP_NUM_THREADS=$(THREADS) .venv/bin/geomtrain prepare --tokenizer bpe8k
	OMP_NUM_THREADS=$(THREADS) .venv/bin/geomtrain train --model mini --preset hetero --data-dir data/classics-bpe8k \
		--max-iters 150 --warmup-iters 15 --eval-interval 50 --out-dir runs/demo-hetero --overwrite
