"""``python -m geomtrain`` (also what ``torchrun -m geomtrain train ...`` runs)."""

import sys

from .cli import main

sys.exit(main())
