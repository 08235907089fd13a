"""`python -m kakeyaturbo.eval eval ppl ...`: the same commands as the `kakeyaturbo` script."""

import sys

from kakeyaturbo.eval.cli import main

sys.exit(main())
