"""`python -m serving`: the same as `clipms-serve`."""

import sys

from serving.cli import main

sys.exit(main())
