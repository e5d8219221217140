"""The rehearsal's stores (rstar2_cli/rehearsal_data.py): every file the production profile names, in its
published layout, read by the project's own readers without a rejected row; curation keeps problems from
them (no 8-gram shared with the benchmarks); the SFT files are read in their three formats."""

from __future__ import annotations

from rstar2_cli.rehearsal import overlay_overrides
from rstar2_cli.rehearsal_data import datasets
from rstar2_core.config import load_config


def _local(tmp_path):
    """The profile (with the overlay) reading the rehearsal's files from `tmp_path` instead of S3."""
    files = datasets()
    base = load_config("qwen3-14b-mi300x", overlay_overrides())
    local = {}
    for url, body in files.items():
        path = tmp_path / url.removeprefix("s3://").replace("/", "_")
        path.write_bytes(body)
        local[url] = path.as_uri()
    over = [*overlay_overrides(), f'storage.root="{(tmp_path / "runs").as_uri()}"', "storage.shared_filesystem=true"]
    over += [f'data.sources.{i}.url="{local[s.url]}"' for i, s in enumerate(base.data.sources)]
    over += [f'eval.benchmarks.{i}.url="{local[b.url]}"' for i, b in enumerate(base.eval.benchmarks)]
    over.append("data.sft_sources=[" + ", ".join(f'"{local[u]}"' for u in base.data.sft_sources) + "]")
    return base, load_config("qwen3-14b-mi300x", over)


def test_every_file_the_profile_names_is_made_in_its_layout(tmp_path):
    from rstar2_core.data.benchmarks import load_benchmark
    from rstar2_core.data.curate import curate
    from rstar2_core.sft.data import build_sft_dataset

    base, cfg = _local(tmp_path)
    assert set(datasets()) == ({s.url for s in base.data.sources} | set(base.data.sft_sources)
                               | {b.url for b in base.eval.benchmarks})
    for b in cfg.eval.benchmarks:
        bench = load_benchmark(b, cfg)
        assert len(bench.problems) == 2 and not bench.rejected, (b.name, bench.rejected)    # the overlay limit
    nolabel = cfg.model_copy(update={"data": cfg.data.model_copy(update={
        "label_check": cfg.data.label_check.model_copy(update={"enabled": False})})})
    ref = curate(nolabel, (tmp_path / "curated").as_uri(), progress=False)
    assert ref.counts["decontamination"] == {} and ref.counts["malformed"] == {}, ref.counts
    assert ref.n_rows >= 40 and set(ref.counts["kept_by_source"]) == {"math_dapo", "aops_c4_high_school_math",
                                                                      "project_euler"}, ref.counts
    sft = build_sft_dataset(cfg, (tmp_path / "sft.jsonl").as_uri())
    assert sft.counts["format/openai"] == 48 and sft.counts["format/sharegpt"] == 24
    assert not [k for k in sft.counts if k.startswith("rejected/")], sft.counts
