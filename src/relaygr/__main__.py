"""``python -m relaygr`` runs the command line."""

import sys

from relaygr.cli.main import main

sys.exit(main())
