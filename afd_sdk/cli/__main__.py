"""``python -m afd_sdk.cli …``: the ``afd`` command without its console script."""

import sys

from afd_sdk.cli import main

sys.exit(main())
