"""``python -m dpkit.native [FOLDER]``: compiles every C helper and C++ extension of dpkit/native now, ahead of its
first use, and prints what it built or why not (``dpkit.native.main``)."""

import sys

from dpkit.native import main

sys.exit(main())
