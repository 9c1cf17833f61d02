"""`python -m benchmarks.throughput <subcommand>` (the `python -m benchmarks.throughput` console
script)."""

import sys

from benchmarks.throughput import main

sys.exit(main())
