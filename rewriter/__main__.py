import sys

from rewriter.cli import main

sys.exit(main())
