"""Entered from outside: the pytest plugin, the start-up hook."""
