"""Public: ``%%configure`` presets (implementation: :mod:`sparkhvd.driver.presets`)."""
from sparkhvd.driver.presets import (Preset, PresetError, list_preset_names,
                                     load_preset)

__all__ = ['Preset', 'PresetError', 'list_preset_names', 'load_preset']
