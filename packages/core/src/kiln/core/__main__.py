import sys

from kiln.core.cli._cli import main

sys.exit(main())
