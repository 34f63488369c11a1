"""`mtrain train --nproc-per-node N CONFIG key=value ...`: check the config once, then start the ranks.

The launching process loads the config and runs the whole preflight (`mtrain.preflight`) for the world size the
job will have, before any rank exists: a bad setting is one line, `mtrain: error: ConfigError: KEY: ...`, and exit
status 2, whatever N is (under a plain `torchrun`, every rank prints that line and torchrun then adds its own
`ChildFailedError` report and exits 1). A hub id is resolved (downloaded once) here, and every rank is handed the
same local folder.

The ranks are then started by torch's own elastic launcher (`torch.distributed.run`, the code behind `torchrun`,
single node, `--standalone` rendezvous), each running `python -m mtrain train CONFIG key=value ...` exactly as
under `torchrun --nproc-per-node N -m mtrain train ...`: same environment variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT, OMP_NUM_THREADS=1 unless set), same output. A rank that fails later gives one
closing line naming it and its exit status, which becomes this command's exit status.
"""
from __future__ import annotations

import os
import sys

from mtrain.config import NOTES_SHOWN, ConfigError


def inside_launcher() -> bool:
    """Started by torchrun (or this launcher): the elastic agent sets these for every rank."""
    return "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ


def resolved_overrides(before, after) -> list[str]:
    """key=value lines that hand the ranks the folders preflight resolved (hub ids -> local snapshots)."""
    from mtrain.preflight_models import MODEL_PATH_KEYS
    out = []
    for section, attr in MODEL_PATH_KEYS:
        a, b = before, after
        for part in section.split("."):
            a, b = getattr(a, part), getattr(b, part)
        if getattr(a, attr) != getattr(b, attr):
            out.append(f"{section}.{attr}={getattr(b, attr)}")
    return out


def launch(config: str | None, overrides: list[str], nproc: int) -> int:
    import copy
    from mtrain.config import load_config
    from mtrain.preflight import preflight
    from mtrain.preflight_models import finished_run
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node: {nproc}: give the number of ranks to start on this machine (>= 1)")
    if inside_launcher():
        raise ConfigError("--nproc-per-node: this process is already a rank of torchrun: run `mtrain train "
                          "--nproc-per-node N CONFIG ...` on its own, or `torchrun ... -m mtrain train CONFIG ...` "
                          "without --nproc-per-node")
    cfg = load_config(config, overrides)
    asked = copy.deepcopy(cfg)
    preflight(cfg, world=nproc)  # one line and exit 2 (mtrain.__main__) before any rank exists
    done = finished_run(cfg)
    if done:
        print(done, flush=True)
        return 0
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run as elastic_run
    cmd = ["--standalone", "--nproc-per-node", str(nproc), "-m", "mtrain", "train",
           *([config] if config else []), *overrides, *resolved_overrides(asked, cfg)]
    # the ranks load the same config again: its notes were printed above, once (mtrain.config.load_config)
    os.environ[NOTES_SHOWN] = "1"
    try:
        elastic_run(get_args_parser().parse_args(cmd))
    except ChildFailedError as e:
        import signal
        # The agent stops the other ranks with SIGTERM once one fails, and lists them as failures too: name a rank
        # that ended on its own (the lowest), not rank 0 because the agent stopped it.
        own = {r: f for r, f in e.failures.items() if f.exitcode != -signal.SIGTERM}
        rank, failure = min((own or e.failures).items())
        code = failure.exitcode
        how = f"exit status {code}" if code >= 0 else f"signal {-code}"
        sys.stdout.flush()
        sys.stderr.write(f"mtrain: rank {rank} ended with {how} (its output above says why); the other ranks "
                         f"were stopped\n")
        sys.stderr.flush()
        return code if 0 < code < 256 else 1
    except SignalException as e:  # Ctrl-C, kill -TERM: the agent has stopped the ranks; its traceback says nothing
        return stopped(cfg, e.sigval)
    return 0


def stopped(cfg, sig) -> int:
    """One line for a run stopped by a signal, naming where the same command picks up (nothing is saved at the
    stop: steps after that checkpoint are trained again); the shell's status for a signal, 128 + its number."""
    import signal
    from mtrain.trainer.checkpoint import find_latest
    latest = find_latest(cfg.train.run_dir, report=None)
    if cfg.train.resume == "auto":
        then = (f"The same command resumes from {latest}" if latest else
                "The same command starts the run again (no checkpoint was saved yet)")
    else:  # never, or a fixed checkpoint: the same command would not pick up where this run stopped
        then = f"Resume with train.resume=auto (the last checkpoint is {latest})" if latest else "No checkpoint was saved"
    sys.stdout.flush()
    sys.stderr.write(f"mtrain: stopped by {signal.Signals(sig).name}; every rank was stopped. {then}\n")
    sys.stderr.flush()
    return 128 + int(sig)
