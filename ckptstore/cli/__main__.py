"""``python -m ckptstore.cli``: the ``ckptstore`` command."""

import sys

from ckptstore.cli import main

sys.exit(main())
