"""expecttest for PyTorch's test utilities where the system has no package of it (Debian 12 and 13
ship none; pytorch_suite.py puts this folder on the path only then). PyTorch's common_utils
imports it for TestCase and ACCEPT; the distributed suite uses neither assertExpectedInline nor
the rewriting of expected strings in the test's source that the real package does with
EXPECTTEST_ACCEPT=1, so this compares only, and accepting is off."""
import unittest

ACCEPT = False


class TestCase(unittest.TestCase):
    longMessage = True

    def assertExpectedInline(self, actual, expect, skip=0):
        self.assertMultiLineEqual(expect, actual)
