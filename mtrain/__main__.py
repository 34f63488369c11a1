"""`mtrain` command line: train, serve, plot, gap-probe, init-tiny.

    mtrain train --nproc-per-node N CONFIG.yaml [a.b.c=value ...]  # checks the config, then starts N ranks
    mtrain train CONFIG.yaml [a.b.c=value ...]     # one rank, or each rank under torchrun
    mtrain serve CONFIG.yaml [a.b.c=value ...]     # the OpenAI front on the configured model, no training
    mtrain plot RUN_DIR [--out PNG]
    mtrain gap-probe CONFIG.yaml [a.b.c=value ...] # where the engine-vs-trainer logprob gap comes from, layer by layer
    mtrain init-tiny --arch llama --out DIR        # a tiny random HF model for CPU runs and tests
"""
from __future__ import annotations

import argparse
import os
import sys


def _train(args) -> int:
    if args.nproc_per_node is not None:  # check once, then start the ranks through torch's elastic launcher
        from mtrain.launch import launch
        return launch(args.config, args.overrides, args.nproc_per_node)
    from mtrain.config import load_config
    from mtrain.preflight import preflight
    from mtrain.preflight_models import finished_run
    from mtrain.run_output import quiet_known_warnings
    from mtrain.debug_signals import install_stack_dump_signal
    from mtrain.trainer.watchdog import stop_with_parent
    install_stack_dump_signal()  # `kill -USR1 PID`: every thread's stack to stderr, for a hung rank
    stop_with_parent()  # a SIGKILLed torchrun must not leave its workers training
    quiet_known_warnings()  # before megatron is imported: most of its warnings come at import
    cfg = load_config(args.config, args.overrides)  # before importing the trainer: a bad key fails in a second
    preflight(cfg)  # files, model vs layout, batch splits: one line, exit 2, no process group
    done = finished_run(cfg)  # started again after its last step: say so instead of loading anything
    if done:
        _rank0_print(done)
        return 0
    try:
        from mtrain.trainer.loop import Trainer
        trainer = Trainer(cfg)  # every rank, whatever engine.placement (the roles differ: mtrain/trainer/roles.py)
        try:
            trainer.run()
        except BaseException:
            trainer.close()
            raise
    except KeyboardInterrupt:  # Ctrl-C, or the launcher passing its SIGINT on to every rank
        from mtrain.launch import inside_launcher, stopped
        if inside_launcher():
            return 130  # the launcher says it once, for every rank (a traceback per rank said nothing)
        import signal
        return stopped(cfg, signal.SIGINT)
    trainer.finish()
    run = cfg.train.run_dir
    _rank0_print(f"done: results in {run} (metrics.jsonl, checkpoints/); plot with: mtrain plot {run}")
    if torch_cuda_was_used():
        # Every file is written and every engine stopped; what is left are CUDA blocks still mapped by engines that
        # were killed (their loaders keep the last bucket open), which torch would free in its static destructors
        # after the driver began shutting down: on 2 x H200 that aborted a finished DeepSeek-V3 run with "CUDA error:
        # driver shutting down" (docs/archive/results-2026-11.md, section 34). The driver reclaims this process's memory on exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _rank0_print(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


def torch_cuda_was_used() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def _serve(args) -> int:
    from mtrain.config import load_config
    from mtrain.debug_signals import install_stack_dump_signal
    install_stack_dump_signal()  # `kill -USR1 PID`: every thread's stack to stderr
    cfg = load_config(args.config, args.overrides)
    from mtrain.serve_command import serve
    return serve(cfg)


def _plot(args) -> int:
    from mtrain.plot import plot_run
    print(plot_run(args.run_dir, args.out))
    return 0


def _gap_probe(args) -> int:
    from mtrain.run_output import quiet_known_warnings
    quiet_known_warnings()
    from mtrain.gap_probe import main as gap_probe_main
    return gap_probe_main(args)


def _init_tiny(args) -> int:
    from mtrain.tiny_hf import write_tiny_hf
    problem = _init_tiny_problem(args)
    if problem:
        print(f"mtrain init-tiny: error: {problem}", file=sys.stderr)
        return 2
    print(write_tiny_hf(args.arch, args.out, seed=args.seed, config_path=args.config,
                        overrides=dict(kv.split("=", 1) for kv in args.set)))
    return 0


def _init_tiny_problem(args) -> str | None:
    """What would stop write_tiny_hf part way (a KeyError, JSONDecodeError, NotADirectoryError traceback), said first."""
    import json
    from pathlib import Path
    from mtrain.paths import nearest_existing
    from mtrain.tiny_configs import TINY
    from mtrain.tiny_hf import VLM_ARCHS
    if not args.arch and not args.config:
        return "give --arch or --config"
    if args.config is None and args.arch not in TINY and args.arch not in VLM_ARCHS:
        return f"--arch {args.arch}: not a tiny architecture; one of: {', '.join(sorted({*TINY, *VLM_ARCHS}))}"
    for kv in args.set:
        key, eq, value = kv.partition("=")
        if not eq or not key:
            return f"--set {kv}: must look like key=value (a JSON value)"
        try:
            json.loads(value)
        except ValueError:
            return f"--set {kv}: the value must be JSON (a string in quotes: {key}='\"{value}\"')"
    if args.config is not None:
        try:
            if not isinstance(json.loads(Path(args.config).read_text()), dict):
                return f"--config {args.config}: must hold a JSON object (a HF config.json)"
        except (OSError, ValueError) as e:
            return f"--config {args.config}: cannot read it ({e})"
    existing = nearest_existing(args.out)
    if not existing.is_dir():
        return f"--out {args.out}: {existing} is a file, not a folder"
    return None


def main(argv: list[str] | None = None) -> int:
    from mtrain.paths import user_path as path  # `~` in a path argument, as the config's path keys get it
    p = argparse.ArgumentParser(prog="mtrain", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="run RL training from a YAML config plus a.b.c=value overrides")
    t.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="check the config, then start N ranks on this machine (torch's elastic launcher, as torchrun)")
    t.add_argument("config", nargs="?", default=None, type=path)
    t.add_argument("overrides", nargs="*")
    t.set_defaults(fn=_train)
    sv = sub.add_parser("serve", help="serve the configured model behind the OpenAI front (serve.* keys)")
    sv.add_argument("config", nargs="?", default=None, type=path)
    sv.add_argument("overrides", nargs="*")
    sv.set_defaults(fn=_serve)
    pl = sub.add_parser("plot", help="draw reward, KL and logprob diff of a run to a PNG")
    pl.add_argument("run_dir", type=path)
    pl.add_argument("--out", default=None, type=path)
    pl.set_defaults(fn=_plot)
    gp = sub.add_parser("gap-probe", help="compare the trainer's and the engine's activations and logprobs on one "
                        "sequence, layer by layer, against a float64 HF reference")
    gp.add_argument("config", nargs="?", default=None, type=path)
    gp.add_argument("overrides", nargs="*")
    gp.add_argument("--record", type=int, default=0, help="which eval (else train) record's prompt to use")
    gp.add_argument("--new-tokens", type=int, default=32, help="tokens the engine samples after the prompt")
    gp.add_argument("--reference-dtype", default="float64", choices=("float64", "float32"))
    gp.add_argument("--out", default=None, type=path, help="write the full report as JSON here")
    gp.set_defaults(fn=_gap_probe)
    it = sub.add_parser("init-tiny", help="write a tiny random HF model (config.json + safetensors)")
    it.add_argument("--arch", help="one of mtrain.tiny_configs.TINY, or qwen2_5_vl / qwen2_5_vl_gpu (with a processor)")
    it.add_argument("--config", type=path, help="a full HF config.json to instantiate with random weights instead")
    it.add_argument("--out", required=True, type=path)
    it.add_argument("--seed", type=int, default=0)
    it.add_argument("--set", nargs="*", default=[], help="config.json overrides key=value (JSON values)")
    it.set_defaults(fn=_init_tiny)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except Exception as e:
        from mtrain.config import ConfigError
        # The other error classes are imported only now (megatron and all): a config error must not wait for them.
        if not isinstance(e, ConfigError) and not isinstance(e, _user_errors()):
            raise
        print_error_line(e)
        return 2


def print_error_line(e: BaseException) -> None:
    """`mtrain: error: TYPE: message` on this rank's stderr, in one write.

    Every rank prints it, even an error that is the same on every rank: torchrun stops all ranks as soon as the first
    one exits, so a line left to rank 0 alone was lost whenever another rank got there first (3 of 3 tries with 2
    ranks). One `write` of one short line is atomic on a pipe (under PIPE_BUF), so the ranks' lines never interleave;
    under torchrun the same line shows once per rank.
    """
    sys.stdout.flush()
    sys.stderr.flush()  # nothing pending: the line below leaves in a single write of its own
    sys.stderr.write(f"mtrain: error: {type(e).__name__}: {e}\n")
    sys.stderr.flush()


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that name a wrong setting or input (each raised with a message saying which)."""
    from mtrain.config import ConfigError
    from mtrain.data.chat import PromptError
    from mtrain.data.datasets import DatasetError
    from mtrain.data.rewards import RewardError
    from mtrain.dist import ParallelLayoutError
    from mtrain.layouts import LayoutError
    from mtrain.metrics import MetricsError
    from mtrain.models.hf_config import ModelConfigError
    from mtrain.rollout.agents.tito import TemplateError
    from mtrain.rollout.protocol import EngineError
    from mtrain.trainer.checkpoint import CheckpointError
    # TemplateError: a chat template token-in-token-out cannot append turns to (tools, agents): the model's to change
    return (ConfigError, PromptError, DatasetError, RewardError, ParallelLayoutError, LayoutError, ModelConfigError,
            EngineError, CheckpointError, FileExistsError, MetricsError, TemplateError)


if __name__ == "__main__":
    sys.exit(main())
