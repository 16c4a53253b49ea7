"""`python -m maskbench ...` (what `accelerate launch -m maskbench` and `torchrun -m maskbench` run)."""

import sys

from maskbench.cli import main

sys.exit(main())
