"""Each `rstar2` subcommand of the README run as a command (a subprocess of the installed entry point), on
good input where that is cheap and on bad input: a missing file, an unreachable or read-only URL, a
malformed JSONL line, an unknown profile or `--set` key. Bad input exits non-zero with one line on stderr
that names the input (no traceback) and writes nothing under the output URL.

Good input: config profiles|show, sandbox doctor, grade, plan, model prepare|info, sft data, sft train (one
step), rl run (one step) then rl hard-subset. Bad input only: data curate|show,
eval, eval-compare, config show --run, deploy, cluster status|restart|down with no cluster and
`python -m flows.client summary` (its good run needs a finished recipe: tests/integration/test_deployment_e2e.py).
A config error (unknown profile key, bad value) is a headline and one line per bad field, by design.
Whole module ~70 s on 2 cores; without `slow` ~20 s. `grade` and `sandbox run` answer a malformed line with an `invalid_request` record and go on
(their documented streaming contract, exit 0): that is checked as such.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RSTAR2 = str(Path(sys.executable).with_name("rstar2"))
CLOSED_URL = "http://127.0.0.1:9"  # the discard port: nothing listens there
SMALL_SFT = ["--set", "data.synthetic.n_sft=20"]
ONE_SFT_STEP = ["--set", "sft.converged_loss=null", "--set", "sft.steps_after_converged=null",
                "--set", "sft.max_steps=1", "--set", "sft.checkpoint_every=1", "--threads", "1"]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The subprocesses' environment: their own state folder, so nothing touches the checkout's .rstar2."""
    home = tmp_path_factory.mktemp("rstar2-home")
    return {**os.environ, "RSTAR2_HOME": str(home), "PREFECT_API_URL": f"{CLOSED_URL}/api"}


def run(env: dict, *args: str, stdin: str | None = None, module: str | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module, *args] if module else [RSTAR2, *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, timeout=timeout, check=False)


def error_line(p: subprocess.CompletedProcess, *names: str) -> str:
    """The single line a bad input gives: non-zero exit, no traceback, every one of `names` in it."""
    assert p.returncode != 0, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, lines
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def base(env, tmp_path_factory) -> Path:
    """A tiny base checkpoint, built by `rstar2 model prepare` (the command's good-input run)."""
    out = tmp_path_factory.mktemp("models") / "base"
    p = run(env, "model", "prepare", "--profile", "tiny", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"checkpoint_url": str(out)}
    assert (out / "_COMPLETE").exists() and (out / "config.json").exists()
    return out


@pytest.fixture(scope="module")
def sft_jsonl(env, tmp_path_factory) -> Path:
    """A 40-row SFT JSONL written by `rstar2 sft data` (the command's good-input run)."""
    out = tmp_path_factory.mktemp("sft") / "sft.jsonl"
    p = run(env, "sft", "data", "--profile", "tiny", *SMALL_SFT, "--out", str(out))
    assert p.returncode == 0, p.stderr
    ref = json.loads(p.stdout)
    assert ref["n_rows"] == len(out.read_text().splitlines()) > 0
    assert Path(ref["manifest_url"]).exists()
    return out


def test_config_profiles_and_show(env):
    p = run(env, "config", "profiles")
    assert p.returncode == 0 and {"tiny", "smol", "qwen3-14b-mi300x"} <= set(p.stdout.split()), p
    p = run(env, "config", "show", "--profile", "tiny", "--set", "rl.lr=0.5")
    assert p.returncode == 0, p.stderr
    tree = json.loads(p.stdout)
    assert tree["rl"]["lr"] == 0.5 and tree["resolved"]["state_dir"] == env["RSTAR2_HOME"]


@pytest.mark.parametrize("cmd", [["config", "show"], ["sandbox", "doctor"], ["sft", "data", "--out", "OUT"],
                                 ["model", "prepare", "--out", "OUT"]])
def test_unknown_profile_is_one_line(env, tmp_path, cmd):
    out = tmp_path / "out"
    p = run(env, *[str(out) if a == "OUT" else a for a in cmd], "--profile", "no-such-profile")
    error_line(p, "unknown profile 'no-such-profile'", "tiny")
    assert not out.exists()


def test_unknown_or_bad_set_key_names_the_key(env, tmp_path):
    out = tmp_path / "sft.jsonl"
    for key, why in (("sft.no_such_key=1", "unknown field"), ("sft.lr=fast", "valid number")):
        p = run(env, "sft", "data", "--set", key, "--out", str(out))
        # a config error is a headline plus one line per bad field (the field's docstring under it)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.startswith("rstar2: invalid config") and f"{key.split('=')[0]}: " in p.stderr, p.stderr
        assert why in p.stderr, p.stderr
        assert not out.exists()


def test_sandbox_doctor(env):
    p = run(env, "sandbox", "doctor", "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["templates"] and report["probes"] and report["cpus"] >= 1


def test_grade_good_line_and_malformed_line(env):
    lines = [json.dumps({"id": 1, "response": r"so \boxed{12}", "gold": "12"}), '{"id": 2, "response": ']
    p = run(env, "grade", "--workers", "1", "--quiet", stdin="\n".join(lines) + "\n")
    assert p.returncode == 0, p.stderr
    out = [json.loads(x) for x in p.stdout.splitlines()]
    assert [(o["id"], o["reward"], o["reason"]) for o in out] == [(1, 1, "correct"), (None, 0, "invalid_request")]
    assert "rstar2 grade: line 2: not valid JSON" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow  # the tiny checkpoint they need takes ~15 s to build
def test_model_info_good(env, base):
    p = run(env, "model", "info", "--checkpoint", str(base))
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert [info["architecture"]] == json.loads((base / "config.json").read_text())["architectures"]
    assert info["n_params"] > 0 and info["vocab_size"] > 0 and info["checkpoint_url"] == str(base)


@pytest.mark.parametrize("where", ["missing", "unreachable"])
def test_model_info_bad_checkpoint(env, tmp_path, where):
    url = str(tmp_path / "nope") if where == "missing" else f"{CLOSED_URL}/nope"
    error_line(run(env, "model", "info", "--checkpoint", url), "rstar2 model info", url, "not a complete checkpoint")


@pytest.mark.parametrize("cmd", [["model", "prepare"], ["sft", "data"]])
def test_read_only_out_url_writes_nothing(env, cmd):
    url = f"{CLOSED_URL}/out"
    error_line(run(env, *cmd, "--profile", "tiny", *SMALL_SFT, "--out", url), "--out", url, "read-only")


@pytest.mark.slow
def test_sft_train_one_step(env, base, sft_jsonl, tmp_path):
    out = tmp_path / "sft"
    p = run(env, "sft", "train", "--profile", "tiny", *ONE_SFT_STEP, "--base", str(base), "--data", str(sft_jsonl),
            "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])["result"]
    assert result["steps"] == 1 and (out / "final" / "_COMPLETE").exists(), result


@pytest.mark.slow  # the tiny checkpoint they need takes ~15 s to build
def test_sft_train_bad_inputs_write_nothing(env, base, sft_jsonl, tmp_path):
    out = tmp_path / "sft"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(sft_jsonl.read_text().splitlines()[0] + "\n" + '{"turns": [\n')
    cases = [({"--base": str(tmp_path / "nobase")}, ["--base", "nobase", "not a complete checkpoint"]),
             ({"--data": str(tmp_path / "absent.jsonl")}, ["--data", "absent.jsonl", "no such file"]),
             ({"--data": f"{CLOSED_URL}/sft.jsonl"}, ["--data", CLOSED_URL, "no such file"]),
             ({"--data": str(bad)}, [str(bad), "line 2", "not valid JSON"])]
    for change, names in cases:
        opts = {"--base": str(base), "--data": str(sft_jsonl), "--out": str(out), **change}
        p = run(env, "sft", "train", "--profile", "tiny", *ONE_SFT_STEP, *[x for kv in opts.items() for x in kv])
        error_line(p, "rstar2 sft train", *names)
        assert not out.exists(), (change, list(out.rglob("*")))


@pytest.mark.slow  # the tiny checkpoint they need takes ~15 s to build
def test_rl_bad_inputs_write_nothing(env, base, tmp_path):
    out = tmp_path / "rl"
    good = tmp_path / "problems.jsonl"
    good.write_text(json.dumps({"id": "a", "problem": "1+1?", "answer": "2"}) + "\n")
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"id": "a", "problem": \n{bad\n')
    for cmd, ckpt_opt in ((["rl", "run", "--stage", "1"], "--init"), (["rl", "hard-subset", "--stage", "3"], "--checkpoint")):
        cases = [({ckpt_opt: str(tmp_path / "noinit")}, [ckpt_opt, "not a complete checkpoint"]),
                 ({"--data": str(tmp_path / "absent.parquet")}, ["--data", "absent.parquet", "no such file"]),
                 ({"--data": str(malformed)}, [str(malformed), "no usable RL problems", "invalid_json"])]
        for change, names in cases:
            opts = {ckpt_opt: str(base), "--data": str(good), "--out": str(out), **change}
            p = run(env, *cmd, "--profile", "tiny", *[x for kv in opts.items() for x in kv])
            error_line(p, f"rstar2 {' '.join(cmd[:2])}", *names)
            assert not out.exists(), (cmd, change, list(out.rglob("*")))
    p = run(env, "rl", "run", "--stage", "9", "--init", str(base), "--data", str(good), "--out", str(out))
    error_line(p, "--stage 9", "1..3")
    assert not out.exists()


SMALL_RL = [x for o in ("rl.stages.0.steps=1", "rl.prompts_per_step=1", "rl.grpo.group_size=2", "rl.grpo.oversample=1",
                        "rl.stages.0.max_response_tokens=16", "rl.stages.0.max_turns=1", "rl.require_update=false",
                        "rl.stages.2.hard_subset_k=2", "rl.stages.2.max_response_tokens=16", "rl.stages.2.max_turns=1",
                        "sandbox.workers=2") for x in ("--set", o)]


@pytest.mark.slow  # one RL step and a hard-subset selection of 2 problems on the tiny model: ~1 min
def test_rl_run_then_hard_subset_good(env, base, tmp_path):
    """`rl run` trains one step of stage 1 from the base and writes its final checkpoint; `rl hard-subset`
    samples that checkpoint on the problems and keeps those it fails (the untrained tiny model solves none)."""
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                                for i in (3, 4)))
    out, hard = tmp_path / "rl", tmp_path / "hard"
    p = run(env, "rl", "run", "--stage", "1", "--profile", "tiny", *SMALL_RL, "--init", str(base),
            "--data", str(problems), "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])["result"]
    assert res["steps"] == 1 and res["checkpoint_url"] == str(out / "final"), res
    assert (out / "final" / "_COMPLETE").exists()
    p = run(env, "rl", "hard-subset", "--stage", "3", "--profile", "tiny", *SMALL_RL, "--checkpoint",
            str(out / "final"), "--data", str(problems), "--out", str(hard))
    assert p.returncode == 0, p.stderr[-3000:]
    ref = json.loads(p.stdout.strip().splitlines()[-1])
    assert ref["n_rows"] == 2 and ref["url"].startswith(str(hard)) and Path(ref["url"]).exists(), ref
    assert Path(ref["manifest_url"]).exists(), ref


def test_cluster_commands_with_no_cluster(env):
    for action, rc in (("status", 1), ("restart", 1), ("down", 0)):
        p = run(env, "cluster", action)
        assert p.returncode == rc and "Traceback" not in p.stderr, (action, p)
        assert "no local cluster recorded" in p.stderr and "rstar2 cluster up" in p.stderr, (action, p.stderr)
    assert not (Path(env["RSTAR2_HOME"]) / "cluster" / "cluster.json").exists()


def test_flows_client_summary_bad_input(env):
    p = run(env, "summary", "not-a-uuid", module="flows.client")
    error_line(p, "'not-a-uuid' is not a flow run id")
    p = run(env, "summary", "00000000-0000-0000-0000-000000000001", module="flows.client")
    error_line(p, f"{CLOSED_URL}/api does not answer")


def test_plan_good_and_unknown_profile(env):
    p = run(env, "plan", "--profile", "tiny", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)
    error_line(run(env, "plan", "--profile", "no-such-profile"), "unknown profile 'no-such-profile'")


def test_data_eval_config_run_deploy_bad_inputs(env, tmp_path):
    absent = tmp_path / "absent.jsonl"
    out = tmp_path / "out"
    p = run(env, "data", "curate", "--set", f'data.sources=[{{url = "{absent}"}}]', "--out", str(out))
    error_line(p, "rstar2 data curate", str(absent), "no such file")
    error_line(run(env, "data", "show", str(tmp_path / "nothing")), "rstar2 data show", "no manifest")
    error_line(run(env, "eval", "--model", str(tmp_path / "nope"), "--bench", "synthetic", "--out", str(out)),
               "rstar2 eval", "nope", "does not exist")
    error_line(run(env, "eval-compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out / "d.md")),
               "rstar2 eval-compare", "no evaluation report")
    error_line(run(env, "config", "show", "--run", "nope", "--storage-root", str(tmp_path)),
               "rstar2 config show", "'nope'", "no config snapshot")
    error_line(run(env, "deploy", "--api-url", f"{CLOSED_URL}/api", "--health-timeout-s", "1"),
               "rstar2 deploy", f"{CLOSED_URL}/api", "did not answer")
    assert not out.exists()
