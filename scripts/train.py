"""Train a Mamba language model on a task, from a YAML config plus dotted overrides.

    python scripts/train.py                                    # configs/default.yaml
    python scripts/train.py --config configs/induction_heads.yaml trainer.max_steps=500
    python scripts/train.py model.d_model=128 model.ssm_cfg.layer=Mamba2 run_dir=runs/mine
    python scripts/train.py resume=runs/mine                   # continue where it stopped
    python scripts/train.py trainer.devices=2 trainer.strategy=ddp   # two processes

With ``resume=RUN_DIR`` and no ``--config``, the run's own config.yaml is used. Keys, types and
defaults: ssm/training/config.py. Results (config.yaml, checkpoints/, metrics.csv, metrics.json,
model/, curves.png) go to ``run_dir`` (default: a new folder under runs/).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's ssm, whichever one is installed
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help=f"YAML config (default: {DEFAULT_CONFIG.relative_to(ROOT)})")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.max_steps=100"
    )
    args = parser.parse_args(argv)

    # The cpu backend's C kernels are built on a machine's first run (then cached): build them
    # while Lightning is imported and the run is set up, not when the first step needs them.
    from ssm.native import build_in_background

    build_in_background()
    from ssm.training import CheckpointError, ConfigError, load_config, train
    from ssm.training.run import checkpoint_of

    try:
        config_path = args.config
        if config_path is None:
            resume = [o.split("=", 1)[1] for o in args.overrides if o.startswith("resume=")]
            run_config = checkpoint_of(resume[-1]).parent.parent / "config.yaml" if resume else None
            config_path = run_config if run_config is not None and run_config.is_file() else DEFAULT_CONFIG
        config = load_config(config_path, args.overrides)
        result = train(config)
    except (ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0 if not result.interrupted else 1


if __name__ == "__main__":
    sys.exit(main())
