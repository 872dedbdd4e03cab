"""``python -m gradzip`` runs the ``gradzip`` command."""
import sys

from .cli import main

sys.exit(main())
