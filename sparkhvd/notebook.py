"""Public: notebook helpers (implementation: :mod:`sparkhvd.driver.notebook`)."""
from sparkhvd.driver.notebook import register_configure_magic, show_curves

__all__ = ['register_configure_magic', 'show_curves']
