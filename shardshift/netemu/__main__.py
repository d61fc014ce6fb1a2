"""`python -m shardshift.netemu`: the command line of link emulation (see `cli.py`)."""

import sys

from shardshift.netemu.cli import main

sys.exit(main())
