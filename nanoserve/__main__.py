import sys

from nanoserve.cli import main

sys.exit(main())
