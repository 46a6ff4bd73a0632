"""`python -m foreshock` is the `foreshock` command."""
import sys

from foreshock.cli import main

sys.exit(main())
