"""`python -m pdserve.benchmarks.chaos` is `pdserve bench chaos`."""

import os
import sys

# The soak starts nodes (fork + exec, with a pre-exec hook) while its gRPC client threads
# run. gRPC's fork handlers would restart its threads inside the child before the exec, and
# one crashed there (SIGSEGV in an event_engine thread, the node "exited -11" at once).
# Nothing here needs gRPC across a fork, so they are off; read when gRPC starts.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from pdserve import process_gc  # noqa: E402
from pdserve.benchmarks.chaos.cli import main  # noqa: E402  (after the environment is set)

process_gc.own_process()
sys.exit(main())
