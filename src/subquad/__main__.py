"""``python -m subquad``: the ``subquad`` command (``info``, ``bench``, ``--version``)."""

import sys

from ._cli import main

sys.exit(main())
