"""Which Parquet tables are read where they lie (sparkhvd.data.in_place.groups_reason): the
row-group sizes a rank can read only its share of, within the reading memory bound."""
from __future__ import annotations

from sparkhvd.data.in_place import groups_reason
from sparkhvd.data.sharding import READ_MEMORY_BYTES

MB = 1 << 20


def test_small_row_groups_are_read_in_place():
    assert groups_reason(4 * MB, 1000 * MB, 24) is None
    assert groups_reason(512 << 10, 10 * MB, 24) is None


def test_large_row_groups_in_a_small_table_would_be_read_by_several_ranks():
    why = groups_reason(15 * MB, 30 * MB, 24)
    assert why and "hold up to 15 MB" in why and "far more than its share" in why
    assert "parquet.block.size" in why


def test_row_groups_that_p_of_would_not_fit_the_reading_bound_are_materialised():
    """Spark's default 128 MB row groups in a table of 30 GB hold 10 per partition -- small
    beside a partition, but a rank reading all 24 partitions would hold 3 GB."""
    why = groups_reason(128 * MB, 30_720 * MB, 24)
    assert why and "24 partitions" in why and "3072 MB" in why
    assert f"{READ_MEMORY_BYTES >> 20} MB reading bound" in why and "parquet.block.size" in why
    assert groups_reason(10 * MB, 10_000 * MB, 24) is None, "24 x 10 MB fits 256 MB"
    assert groups_reason(10 * MB, 10_000 * MB, 48) is not None, "48 x 10 MB does not"
