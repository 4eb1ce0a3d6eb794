"""``python -m online_rlhf.loop ...``: the loop's bookkeeping commands (:func:`online_rlhf.loop.cli.main`)."""

import sys

from .cli import main

raise SystemExit(main(sys.argv[1:]))
