"""`python -m linattn_lib.distributed`: the multi-process check of chapter 9."""
import sys

from .sequence_parallel import main

if __name__ == "__main__":
    sys.exit(main())
