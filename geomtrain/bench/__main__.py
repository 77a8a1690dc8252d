"""``python -m geomtrain.bench ARGS`` is ``geomtrain bench ARGS``: the entry script, run, never imported."""

import sys

from geomtrain.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
