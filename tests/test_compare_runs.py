"""examples/smollm2/compare_runs.py: eval curves, the first eval step at the teacher's final accuracy, the per-step
reverse KL and the median step-time split of runs read from their metrics.jsonl, and the figure."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "smollm2" / "compare_runs.py"


def write_run(d: Path, evals: dict, steps: list[dict]) -> Path:
    d.mkdir(parents=True)
    recs = [{"step": s, "eval/reward_mean": a} for s, a in evals.items() if s == 0]
    for i, extra in enumerate(steps, 1):
        recs.append({"step": i, "weight_version": i, "reward/mean": 0.1 * i, **extra})
        if i in evals:
            recs.append({"step": i, "eval/reward_mean": evals[i]})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def test_curves_target_step_kl_and_split(tmp_path):
    t = [{"time/rollout": r, "time/logprobs": 1.0, "time/train": 2.0 * r, "time/sync": 0.1} for r in (1.0, 3.0, 2.0, 9.0)]
    teacher = write_run(tmp_path / "t", {0: 0.3, 2: 0.5, 4: 0.7}, t)
    kl = [0.4, 0.2, 0.1, 0.05]
    student = write_run(tmp_path / "s", {0: 0.3, 2: 0.72, 4: 0.75},
                        [dict(x, **{"distill/reverse_kl": k}) for x, k in zip(t, kl)])
    late = write_run(tmp_path / "l", {0: 0.3, 2: 0.4, 4: 0.6}, t)
    out = tmp_path / "cmp"
    p = subprocess.run([sys.executable, str(SCRIPT), f"teacher={teacher}", f"student={student}", f"late={late}",
                        "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    runs = {r["name"]: r for r in json.loads((out / "summary.json").read_text())["runs"]}
    assert runs["teacher"]["target_accuracy"] == 0.7  # the first run's final eval
    assert [runs[n]["first_step_at_target"] for n in ("teacher", "student", "late")] == [4, 2, None]
    assert runs["student"]["distill_reverse_kl_per_step"] == kl
    assert "distill_reverse_kl_per_step" not in runs["teacher"]
    # medians of (1, 3, 2, 9) = 2.5, of the doubled values 5.0
    assert runs["student"]["median_step_split_s"] == {"rollout": 2.5, "logprobs": 1.0, "train": 5.0, "sync": 0.1}
    assert [e["step"] for e in runs["late"]["eval_curve"]] == [0, 2, 4]
    assert (out / "curves.png").stat().st_size > 10_000
    assert len(p.stdout.strip().splitlines()) == 4  # a line per run and the files written


def test_base_run_gives_step_0_to_runs_without_it(tmp_path):
    base = write_run(tmp_path / "b", {0: 0.33}, [{}])
    t = write_run(tmp_path / "t", {2: 0.6}, [{}, {}])
    p = subprocess.run([sys.executable, str(SCRIPT), f"t={t}", f"b={base}", "--base", str(base), "--out",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    runs = json.loads((tmp_path / "o" / "summary.json").read_text())["runs"]
    assert runs[0]["eval_curve"] == [{"step": 0, "accuracy": 0.33, "from_base_run": str(base)}, {"step": 2, "accuracy": 0.6}]
    assert runs[1]["eval_curve"] == [{"step": 0, "accuracy": 0.33}]  # its own step 0 stays as logged


def test_a_run_without_metrics_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), f"x={tmp_path}"], capture_output=True, text=True, timeout=60,
                       cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert p.returncode != 0 and p.stderr.strip().splitlines() == [
        f"compare_runs: error: 'x={tmp_path}': want NAME=RUN_DIR with a metrics.jsonl"]
