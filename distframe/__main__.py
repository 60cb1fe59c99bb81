"""``python -m distframe train ...``: the same as the ``distframe`` console script."""
from distframe.cli import entry_point

if __name__ == "__main__":
    entry_point()
