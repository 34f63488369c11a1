"""benchmarks/run_gpu.sh as a suite, checked on a CPU: its heartbeat (a line at least every period while an entry
runs), its catalogue against its commands, and the entries the docs name (every GPU figure of docs/results.md names
one, and each exists)."""
from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "run_gpu.sh"


def test_heartbeat_prints_every_period_while_the_entry_runs_and_returns_when_it_ends(tmp_path):
    """run_gpu.sh's own wait function on a sleeping process that writes a line every 0.5 s for 4 s, period 1 s:
    a line at most ~1.5 s apart (the loop's 0.5 s sleep; 2.5 s allowed on a loaded machine) carrying the log's
    last line, and the function returns once the process has ended (the 4 s it runs, plus slack for the load)."""
    log = tmp_path / "log_demo.txt"
    cmd = (f"source {SCRIPT}; (for i in $(seq 8); do echo \"line $i\"; echo warning noise; sleep 0.5; done) > {log} & "
           f"heartbeat demo $! {log} 1; echo returned")
    p = subprocess.Popen(["bash", "-c", cmd], stdout=subprocess.PIPE, text=True, cwd="/")
    t0, stamped = time.monotonic(), []
    for line in p.stdout:
        stamped.append((time.monotonic() - t0, line.rstrip("\n")))
    assert p.wait(timeout=30) == 0
    beats = [(t, s) for t, s in stamped if s.startswith("   demo ")]
    assert stamped[-1][1] == "returned" and stamped[-1][0] < 4 + 4, stamped
    assert len(beats) >= 3, stamped
    times = [0.0] + [t for t, _ in beats]
    assert max(b - a for a, b in zip(times, times[1:])) < 2.5, stamped
    for _, s in beats:  # "   demo N s: line K": elapsed seconds, then the log's last line that is not a warning
        m = re.fullmatch(r"   demo (\d+) s: line (\d+)", s)
        assert m, s


def _catalogue() -> list[str]:
    out = subprocess.run(["bash", str(SCRIPT), "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def test_every_catalogue_entry_has_exactly_one_command():
    """Every name of the catalogue has a branch in run_one, and no branch is left without a catalogue line."""
    text = SCRIPT.read_text()
    body = text[text.index("run_one() {"):text.index("\n}\n", text.index("run_one() {"))]
    branches = [n for pat in re.findall(r"^    ([a-z0-9_|]+)\)", body, re.M) for n in pat.split("|")]
    assert sorted(branches) == sorted(_catalogue())


def _named_entries(text: str) -> list[str]:
    """Entry names in `... run_gpu.sh NAME [NAME ...]` code spans (a span may break across lines)."""
    names = []
    for span in re.findall(r"`([^`]*run_gpu\.sh[^`]*)`", text):
        for word in span.split("run_gpu.sh", 1)[1].split():
            if not re.fullmatch(r"[a-z0-9_]+", word) or word == "list":
                break
            names.append(word)
    return names


def test_every_entry_the_docs_name_exists():
    known = set(_catalogue())
    for doc in ("docs/results.md", "benchmarks/README.md", "README.md", "BUILD.md"):
        unknown = [n for n in _named_entries((REPO / doc).read_text()) if n not in known]
        assert not unknown, f"{doc} names run_gpu.sh entries that do not exist: {unknown}"


def test_every_gpu_figure_of_the_results_names_its_entry():
    """A section of docs/results.md measured on an H100 or H200 names the run_gpu.sh entry that measures it."""
    text = (REPO / "docs" / "results.md").read_text()
    known = set(_catalogue())
    missing = []
    for section in re.split(r"\n(?=## )", text)[1:]:
        title = section.splitlines()[0]
        if re.search(r"\bH[12]00\b", section) and not set(_named_entries(section)) & known:
            missing.append(title)
    assert not missing, f"GPU figures without a run_gpu.sh entry: {missing}"
