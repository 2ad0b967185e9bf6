"""`python -m shardema ...`: the `shardema` command (_cli.py)."""
import sys

from ._cli import main

sys.exit(main())
