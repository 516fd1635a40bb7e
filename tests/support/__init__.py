"""Helpers shared by the tests of several rooms (not tests themselves)."""
