import sys

from jaxdist.advise.cli import main

sys.exit(main())
