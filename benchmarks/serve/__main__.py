"""`python -m benchmarks.serve` is `pdserve bench serve`."""

import sys

from benchmarks.serve.cli import main

sys.exit(main())
