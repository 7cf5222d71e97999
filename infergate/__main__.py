import sys

from infergate.cli import main

sys.exit(main())
