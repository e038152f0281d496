"""Imported at interpreter start by ``breakpod_autostart.pth`` when
``BREAKPOD_POST_MORTEM`` is true, so crashes park with no code change."""

from breakpod.shim import install_excepthook

install_excepthook()
