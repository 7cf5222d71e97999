import sys

from infergate.main import main

sys.exit(main())
