"""Run by tests/training/test_train.py (not a test module): trains with the overrides on its
command line and records, in OUT/rank<R>.pt for each rank R, the inputs of every training batch,
the flattened parameters after every step, and the run directory the rank used.

    python tests/training/ddp_probe.py OUT key=value ...

With trainer.devices=2, Lightning starts rank 1 by running this same command line again."""

from __future__ import annotations

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch

from ssm.training import load_config, train


class Record(pl.Callback):
    def __init__(self):
        self.rank, self.inputs, self.params = None, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rank = trainer.global_rank
        self.inputs.append(batch[0].detach().cpu().clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.params.append(torch.cat([p.detach().cpu().flatten() for p in pl_module.parameters()]))


def main(argv: list[str]) -> int:
    out, overrides = Path(argv[0]), argv[1:]
    record = Record()
    result = train(load_config(None, overrides), callbacks=(record,))
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"inputs": record.inputs, "params": record.params, "run_dir": str(result.run_dir.resolve())},
        out / f"rank{record.rank}.pt",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
