"""``python -m tessera.runtime.cli``: the ``tessera`` command."""

import sys

from tessera.runtime.cli import main

sys.exit(main())
