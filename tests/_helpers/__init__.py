"""Helpers shared by the test folders (tests/ is on sys.path: `from _helpers.common import ROOT`)."""
