#!/usr/bin/env python
"""The test runner of this tiny Django-style project: the command line of Django's tests/runtests.py
(`--verbosity 2 --settings=test_sqlite --parallel 1 LABEL ...`, labels are test modules under tests/)
and the output of Django's runner at verbosity 2 as SWE-bench's Django images print it (Python < 3.11):
`test_name (module.Class) ... ok`, then `FAIL:` / `ERROR:` blocks, `Ran N tests`, `OK` or `FAILED`."""

import argparse
import os
import sys
import unittest
from unittest.util import strclass

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


class DjangoStyleResult(unittest.TextTestResult):
    def getDescription(self, test):
        return f"{test._testMethodName} ({strclass(test.__class__)})"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("labels", nargs="*")
    parser.add_argument("--verbosity", type=int, default=1)
    parser.add_argument("--settings")
    parser.add_argument("--parallel", type=int, default=1)
    args = parser.parse_args()
    sys.path[:0] = [TESTS_DIR, os.path.dirname(TESTS_DIR)]
    print(f"Testing against Django installed in '{os.path.dirname(TESTS_DIR)}/minidjango'", flush=True)
    labels = args.labels or ["auth_tests.test_validators"]
    suite = unittest.defaultTestLoader.loadTestsFromNames(labels)
    print("System check identified no issues (0 silenced).", flush=True)
    runner = unittest.TextTestRunner(verbosity=args.verbosity, resultclass=DjangoStyleResult, stream=sys.stderr)
    result = runner.run(suite)
    sys.exit(0 if result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
