"""``python -m kvlink.proxy``: same as ``kvlink proxy``."""

from kvlink.proxy.cli import main

raise SystemExit(main())
