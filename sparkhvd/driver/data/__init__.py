"""The driver half of ``DataFrameDataset``: checks, Parquet materialisation, reuse."""
