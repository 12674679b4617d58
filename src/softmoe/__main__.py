"""``python -m softmoe``: the ``softmoe`` command."""

import sys

from softmoe.cli import main

sys.exit(main())
