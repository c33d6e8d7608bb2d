"""`python -m mlxq.producer.cli`: the `mlxq` command."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
