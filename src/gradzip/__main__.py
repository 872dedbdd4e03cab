"""``python -m gradzip`` runs the ``gradzip`` command."""
import sys

from .tools.cli import main

sys.exit(main())
