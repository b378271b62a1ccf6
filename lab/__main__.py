"""``python -m lab`` is the same as the ``shardlab`` console script."""

from lab.cli.main import main

raise SystemExit(main())
