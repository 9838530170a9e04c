import sys

from rewriter.commands.cli import main

sys.exit(main())
