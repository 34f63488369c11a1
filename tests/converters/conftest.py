"""Converter tests: registers the `slow` marker (slow tests still run in the default suite)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: loads a real model (tens of seconds); still part of the default suite")
