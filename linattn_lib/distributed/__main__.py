"""`python -m linattn_lib.distributed`: the multi-process check of chapter 9 (see `cli.py`).

Only this entry point lives here. The package never imports this module, so runpy runs it
fresh (no "found in sys.modules" warning), and the ranks that `launch` starts never re-run it.
"""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
