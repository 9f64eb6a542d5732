"""vlrl entry point: config → distributed init → build → train().

    torchrun --nproc-per-node 2 train.py --config configs/demo.yaml trainer.max_steps=20
    torchrun --nproc-per-node 8 train.py --config configs/clevr_qwen2_5_vl_3b.yaml model.path=/models/Qwen2.5-VL-3B-Instruct
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        train.py --config configs/geo3k_qwen2_5_vl_7b.yaml

Arguments after the config are `key.sub=value` overrides; an unknown key fails at start.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch.distributed as dist

from grpo.config import ConfigError, load_config
from grpo.trainer import NonFiniteStop, Trainer
from models.parallel import init_distributed, shutdown_distributed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML config file (configs/*.yaml)")
    parser.add_argument("--eval-only", action="store_true", help="only run the held-out evaluation and print it")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", 0)) == 0 else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    init_distributed(cfg.parallel.backend)
    clean = False
    try:
        try:
            trainer = Trainer(cfg)
        except ConfigError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return 2
        if args.eval_only:
            result = trainer.evaluate()
        else:
            try:
                trainer.train()
            except NonFiniteStop as exc:
                print(f"stopped: {exc}", file=sys.stderr, flush=True)
                return 3
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
