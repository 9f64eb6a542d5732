"""vlrl entry point: config → distributed init → build → train().

    torchrun --nproc-per-node 2 train.py --config configs/demo.yaml trainer.max_steps=20
    torchrun --nproc-per-node 8 train.py --config configs/clevr_qwen2_5_vl_3b.yaml model.path=/models/Qwen2.5-VL-3B-Instruct
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        train.py --config configs/geo3k_qwen2_5_vl_7b.yaml

Arguments after the config are `key.sub=value` overrides; an unknown key fails at start.

Exit codes: 0 done, or stopped by SIGTERM/SIGINT with a checkpoint written; 2 a config, run-folder
or checkpoint problem found at start (the message says what to change); 3 too many non-finite
steps in a row (stopped with a checkpoint). Under torchrun, a worker whose launcher dies gets
SIGTERM (stop after this step with a checkpoint), and is killed if still running
`ORPHAN_GRACE_S` later.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time

import torch.distributed as dist

from grpo.checkpoint import CheckpointError
from grpo.config import ConfigError, load_config
from grpo.run_folder import RunFolderError
from grpo.trainer import NonFiniteStop, OutOfMemoryStop, Trainer
from models.parallel import allocator_settings, init_distributed, shutdown_distributed

PR_SET_PDEATHSIG = 1
ORPHAN_GRACE_S = 600.0  # one step plus one checkpoint write, after the launcher is gone


def tie_to_launcher(grace_s: float = ORPHAN_GRACE_S) -> None:
    """Make this torchrun worker stop when its launcher dies, even by kill -9.

    On Linux the kernel sends SIGTERM when the parent exits (prctl PR_SET_PDEATHSIG), which the
    preemption guard turns into "finish this step, checkpoint, exit". A daemon thread watches the
    parent PID as well: it sends SIGTERM where prctl is unavailable, and SIGKILL if the worker
    is still running `grace_s` after the launcher went. Only under torchrun: a plain
    `python train.py` keeps running when its shell goes (nohup), as a user would expect.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    armed = False
    if sys.platform.startswith("linux"):
        try:
            armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    threading.Thread(target=_watch_launcher, args=(parent, grace_s, armed), name="launcher-watch",
                     daemon=True).start()


def _watch_launcher(parent: int, grace_s: float, armed: bool) -> None:
    while os.getppid() == parent:  # re-parented (to init or a subreaper) once the launcher is gone
        time.sleep(1.0)
    print(f"[rank {os.environ.get('RANK', '?')}] the launcher (PID {parent}) is gone: stopping after this step; "
          f"killed in {grace_s:.0f} s if still running", file=sys.stderr, flush=True)
    if not armed:  # prctl did not send SIGTERM (or the launcher died before it was armed)
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML config file (configs/*.yaml)")
    parser.add_argument("--eval-only", action="store_true", help="only run the held-out evaluation and print it")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = parser.parse_args(argv)
    tie_to_launcher()
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", 0)) == 0 else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    allocator_settings(cfg.parallel.expandable_segments)
    init_distributed(cfg.parallel.backend)
    clean = False
    try:
        try:
            trainer = Trainer(cfg)
        except ConfigError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return 2
        except (RunFolderError, CheckpointError) as exc:  # every rank raises it; one says it
            if dist.get_rank() == 0:
                print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
        if args.eval_only:
            result = trainer.evaluate()
        else:
            try:
                trainer.train()
            except NonFiniteStop as exc:
                print(f"stopped: {exc}", file=sys.stderr, flush=True)
                return 3
            except OutOfMemoryStop as exc:  # torch's own message after ours: how much it asked for, what was free
                cause = str(exc.__cause__).splitlines()[0] if exc.__cause__ else ""
                print(f"out of memory: {exc}\n  ({cause})", file=sys.stderr, flush=True)
                return 4
            result = trainer.evaluate() if trainer.eval_feeder and not trainer.preempted else {}
        if dist.get_rank() == 0 and result:
            print("final " + json.dumps(result), flush=True)
        trainer = None  # the model, optimizer and engine go before the process groups do
        clean = True
    finally:
        shutdown_distributed(clean)
    return 0


if __name__ == "__main__":
    sys.exit(main())
