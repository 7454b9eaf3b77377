import sys

from kiln.core._cli import main

sys.exit(main())
