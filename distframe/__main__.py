"""``python -m distframe train ...``: the same as the ``distframe`` console script."""
import sys

from distframe.cli import main

if __name__ == "__main__":
    sys.exit(main())
