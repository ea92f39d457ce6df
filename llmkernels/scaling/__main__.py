import sys

from . import main

if __name__ == "__main__":  # a spawned training process imports this module without running a sweep
    sys.exit(main())
