"""The whole run's config: one dataclass per section."""

from __future__ import annotations

from dataclasses import dataclass, field

from .dst import DSTConfig
from .errors import check
from .eval import EvalConfig
from .model import ModelConfig
from .parallel import ParallelConfig
from .run import CheckpointConfig, DataConfig, LoggingConfig, OptimConfig, TrainConfig


@dataclass
class Config:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dst: DSTConfig = field(default_factory=DSTConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def out_dir(self) -> str:
        """The run folder: ``train.out_dir``, which the trainer sets to a new ``runs/<name>/<N>``
        when it is not given (training.run_folder); until then ``runs/<name>``, the folder
        holding this config's runs."""
        return self.train.out_dir or f"runs/{self.name}"

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or f"{self.out_dir}/checkpoints"

    def validate(self) -> Config:
        check(bool(self.name), "name", "must be a non-empty string")
        self.model.validate()
        # here, not in ModelConfig: a run trains its router
        if "moe" in self.model.layer_ffn_types():
            self.model.moe.check_trainable("model.moe")
        self.data.validate()
        self.train.validate()
        self.optim.validate()
        self.dst.validate()
        self.parallel.validate()
        self.logging.validate()
        self.checkpoint.validate()
        self.eval.validate(self.model.max_seq_len)
        check(
            not (self.train.param_dtype == "bfloat16" and self.dst.enabled),
            "train.param_dtype",
            "bfloat16 weights with dst.enabled: DST masks and grows float32 weights; "
            "use train.param_dtype float32",
        )
        check(
            self.train.seq_len <= self.model.max_seq_len,
            "train.seq_len",
            f"seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}",
        )
        return self
