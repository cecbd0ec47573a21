"""`python -m eyas` with the drafter's TTT steps compiled (`eyas.ttt.DRAFTER_COMPILE`, the default on a GPU only),
so the CPU tests can run that path under torchrun."""
import sys

import eyas.ttt as ttt
from eyas.cli import main

if __name__ == "__main__":
    ttt.DRAFTER_COMPILE = True
    sys.exit(main())
