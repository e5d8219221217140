"""`rstar2 data curate|show`, `rstar2 eval` (argument checks before compute), `rstar2 eval-compare`, and
`models:/` resolution against a temporary SQLite MLflow registry."""

from pathlib import Path

import pytest
from eval_fakes import ScriptedSampler, exact_grader

from rstar2_cli.main import main
from rstar2_core.config import config_dir
from tasks.modelref import ModelRefError, resolve_model_ref

FIX = Path(__file__).resolve().parents[2] / "fixtures"


def fixture_profile(tmp_path: Path) -> str:
    text = (config_dir() / "tiny.toml").read_text()
    text += f"""
[[data.sources]]
url = "{FIX / 'dapo_math.jsonl'}"
layout = "dapo"
name = "dapo"

[[data.sources]]
url = "{FIX / 'project_euler.jsonl'}"
layout = "project_euler"
name = "pe"

[[eval.benchmarks]]
name = "aime24"
url = "{FIX / 'aime24.jsonl'}"
layout = "aime"
"""
    p = tmp_path / "fixtures.toml"
    p.write_text(text)
    return str(p)


def test_data_curate_and_show_print_the_counts(tmp_path, capsys):
    prof = fixture_profile(tmp_path)
    rc = main(["data", "curate", "--profile", prof, "--set", "data.synthetic.n_rl=50", "--set",
               "data.synthetic.n_eval=20", "--out", str(tmp_path / "ds")])
    out = capsys.readouterr().out
    assert rc == 0
    lines = {tuple(line.split()[:2]): line.split()[-1] for line in out.splitlines() if line.strip()}
    assert lines[("read", "dapo")] == "7" and lines[("read", "pe")] == "3" and lines[("read", "synthetic")] == "50"
    assert lines[("decontamination", "contaminated:aime24")] == "1"
    assert lines[("answer", "answer_too_many_digits")] == "1"
    assert lines[("malformed", "missing_field:reward_model")] == "1"
    assert lines[("kept", "total")] == str(3 + 2 + 50)
    url = next(line.split()[1] for line in out.splitlines() if line.startswith("dataset"))
    assert main(["data", "show", url]) == 0
    shown = capsys.readouterr().out
    assert "contaminated:aime24" in shown and "source  dapo" in shown


def test_data_curate_reports_a_bad_source(tmp_path, capsys):
    rc = main(["data", "curate", "--set", f"data.sources=[{{url = \"{tmp_path / 'x.jsonl'}\"}}]",
               "--out", str(tmp_path / "o")])
    assert rc == 2 and "no such file" in capsys.readouterr().err


def test_eval_fails_before_compute_on_bad_model_or_bench(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path / "nope"), "--bench", "synthetic"]) == 2
    assert "does not exist" in capsys.readouterr().err
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert main(["eval", "--model", str(ckpt)]) == 2
    assert "not a complete checkpoint" in capsys.readouterr().err
    (ckpt / "_COMPLETE").write_text("{}")
    assert main(["eval", "--model", str(ckpt), "--bench", "aime99"]) == 2
    assert "unknown benchmark 'aime99'" in capsys.readouterr().err
    assert main(["eval", "--model", str(ckpt), "--bench", str(tmp_path / "absent.jsonl")]) == 2
    assert "absent.jsonl" in capsys.readouterr().err
    assert main(["eval", "--model", str(ckpt), "--bench", str(FIX / "aime24.jsonl"), "--layout", "gpqa"]) == 2
    assert "Correct Answer" in capsys.readouterr().err
    assert main(["eval", "--model", "models:/rstar2-agent@champion", "--set",
                 f"tracking.tracking_uri=\"sqlite:///{tmp_path}/none.db\""]) == 2
    assert "no MLflow database" in capsys.readouterr().err


def test_eval_compare_cli(tmp_path, capsys):
    from rstar2_core.config import load_config
    from rstar2_core.data.benchmarks import load_benchmark
    from rstar2_core.eval.run import evaluate

    cfg = load_config("tiny", ["data.synthetic.n_eval=8", "eval.benchmarks.0.limit=8"])
    gold = {q.problem: q.answer for q in load_benchmark(cfg.eval.benchmarks[0], cfg).problems}
    for name, p in (("a", 0.0), ("b", 1.0)):
        evaluate(cfg, checkpoint_url=name, out_url=str(tmp_path / name), k=2, sampler=ScriptedSampler(gold, p),
                 grade_math=exact_grader, progress=False)
    assert main(["eval-compare", str(tmp_path / "a"), str(tmp_path / "b" / "report.json"), "--out",
                 str(tmp_path / "diff.md")]) == 0
    out = capsys.readouterr().out
    assert "8 of 8 problems changed: 8 improved, 0 regressed" in out
    assert (tmp_path / "diff.md").read_text() == out.rstrip("\n") + "\n"
    assert main(["eval-compare", str(tmp_path / "a"), str(tmp_path / "zzz")]) == 2
    capsys.readouterr()
    # another protocol (k 4 against 2): refused, naming the difference, unless the mismatch is allowed
    evaluate(cfg, checkpoint_url="c", out_url=str(tmp_path / "c"), k=4, sampler=ScriptedSampler(gold, 1.0),
             grade_math=exact_grader, progress=False)
    assert main(["eval-compare", str(tmp_path / "a"), str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "not measured the same way (synthetic: k: 2 vs 4" in err and "--allow-mismatch" in err
    assert main(["eval-compare", str(tmp_path / "a"), str(tmp_path / "c"), "--allow-mismatch"]) == 0
    out = capsys.readouterr().out
    assert "**Not measured the same way** (A's value first): synthetic: k: 2 vs 4" in out
    assert "8 of 8 problems changed: 8 improved, 0 regressed" in out


@pytest.mark.slow
def test_models_uri_resolution_against_sqlite_mlflow(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "_COMPLETE").write_text("{}")
    client = MlflowClient(tracking_uri=uri)
    client.create_registered_model("rstar2-agent")
    v1 = client.create_model_version("rstar2-agent", source=ckpt.as_uri(), tags={"checkpoint_url": ckpt.as_uri()})
    v2 = client.create_model_version("rstar2-agent", source=ckpt.as_uri())  # registered without the tag
    client.set_registered_model_alias("rstar2-agent", "champion", v1.version)
    assert resolve_model_ref("models:/rstar2-agent@champion", uri) == ckpt.as_uri()
    assert resolve_model_ref(f"models:/rstar2-agent/{v1.version}", uri) == ckpt.as_uri()
    with pytest.raises(ModelRefError, match=r"no alias 'candidate' \(aliases: \['champion'\]\)"):
        resolve_model_ref("models:/rstar2-agent@candidate", uri)
    with pytest.raises(ModelRefError, match="no `checkpoint_url` tag"):
        resolve_model_ref(f"models:/rstar2-agent/{v2.version}", uri)
    with pytest.raises(ModelRefError, match="no registered model 'other'"):
        resolve_model_ref("models:/other@champion", uri)
    with pytest.raises(ModelRefError, match="models:/NAME@ALIAS"):
        resolve_model_ref("models:/rstar2-agent", uri)
    (ckpt / "_COMPLETE").unlink()
    with pytest.raises(ModelRefError, match="not a complete checkpoint"):
        resolve_model_ref("models:/rstar2-agent@champion", uri)
