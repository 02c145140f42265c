import sys

from kvlink.cli import main

sys.exit(main())
