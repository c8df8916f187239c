"""``python -m multidc.plugins.checkpoint ls|verify|rm URL`` (see ``cli``)."""

import sys

from multidc.plugins.checkpoint.cli import main

sys.exit(main())
