"""`python -m clipms.bench <subcommand>` (the `clipms-bench` console script)."""

import sys

from clipms.bench import main

sys.exit(main())
