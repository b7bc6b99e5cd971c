"""python -m swiftlite"""
import sys

from swiftlite.cli import main

if __name__ == "__main__":
    sys.exit(main())
