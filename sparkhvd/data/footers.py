"""A Parquet file's footer (pyarrow's ``FileMetaData``) as bytes that travel from where it was
read -- the materialiser's writers on the executors, the driver's check of a table read in
place -- to the ranks, and back: Parquet's own footer encoding (a ``_metadata`` file's bytes:
``PAR1``, the Thrift footer, its length, ``PAR1``), read by pyarrow's Parquet reader. No pickle:
bytes that are not a footer are an error, never code that runs."""
from __future__ import annotations

from typing import Any

from sparkhvd.common.patches import forbid_pickled_arrow_types

__side__ = "common"  # pyarrow inside the functions: nothing third-party at import time


def footer_bytes(meta: Any) -> bytes:
    """``meta`` (a ``pyarrow.parquet.FileMetaData``) as bytes for :func:`footer_of`."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    meta.write_metadata_file(sink)
    return sink.getvalue().to_pybytes()


def footer_of(data: bytes) -> Any:
    """The ``FileMetaData`` :func:`footer_bytes` made.

    Raises:
        ValueError: ``data`` is not a Parquet footer (pyarrow's ``ArrowInvalid``).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    forbid_pickled_arrow_types()
    return pq.read_metadata(pa.BufferReader(data))
