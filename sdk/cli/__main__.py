"""`python -m agentrl.cli` runs the command line."""

import sys

from agentrl.cli import main

sys.exit(main())
