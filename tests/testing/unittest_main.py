"""The command line of the Python tests: [--bin-dir DIR] [unittest args]."""

import sys
import unittest


def main(set_bin_dir):
    """Calls set_bin_dir(DIR) when --bin-dir DIR is given, then runs the calling module's
    tests with the remaining arguments."""
    args = sys.argv[1:]
    if "--bin-dir" in args:
        i = args.index("--bin-dir")
        set_bin_dir(args[i + 1])
        del args[i:i + 2]
    unittest.main(module="__main__", argv=[sys.argv[0]] + args, verbosity=2)
