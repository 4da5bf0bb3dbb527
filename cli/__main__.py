"""``python -m cli ...`` = ``dsv4-parity ...``."""

import sys

from cli.main import main

sys.exit(main())
