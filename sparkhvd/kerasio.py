"""Public: Keras models to and from bytes (implementation: :mod:`sparkhvd.storage.kerasio`)."""
from sparkhvd.storage.kerasio import (checkpoint_bytes, local_file, model_bytes,
                                      suffix_of)

__all__ = ['checkpoint_bytes', 'local_file', 'model_bytes', 'suffix_of']
