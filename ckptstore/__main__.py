"""``python -m ckptstore``: the ``ckptstore`` command (as ``python -m ckptstore.cli``)."""

import sys

from ckptstore.cli import main

sys.exit(main())
