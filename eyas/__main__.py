import sys

from .cli import main

if __name__ == "__main__":  # spawned worker processes import this module again (as __mp_main__)
    sys.exit(main())
