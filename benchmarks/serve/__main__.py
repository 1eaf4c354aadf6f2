"""`python -m pdserve.benchmarks.serve` is `pdserve bench serve`."""

import sys

from pdserve import process_gc
from pdserve.benchmarks.serve.cli import main

process_gc.own_process()
sys.exit(main())
