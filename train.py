"""moezoo trainer entry point. Alone: ``python train.py --config zoo/tiny_dense.yaml``; distributed:
``torchrun --nproc_per_node 8 train.py --config zoo/moe_65b.yaml``. See training/cli.py."""

import sys

from moezoo.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
