import sys

from pdhal._tools.cli import main

sys.exit(main())
