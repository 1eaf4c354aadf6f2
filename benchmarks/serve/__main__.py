"""`python -m pdserve.benchmarks.serve` is `pdserve bench serve`."""

import sys

from pdserve.benchmarks.serve.cli import main

sys.exit(main())
