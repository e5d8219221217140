"""Data curation: sources (fsspec JSONL/parquet in public layouts), filters, label check, and
`curate(cfg, out_url) -> DatasetRef`; the synthetic tool-use task (`data.synthetic`); the evaluation
benchmarks' loaders (`data.benchmarks`).

    from rstar2_core.data.curate import curate, read_dataset

See docs/data-and-eval.md.
"""
