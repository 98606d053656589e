import sys

from pdhal._cli import main

sys.exit(main())
