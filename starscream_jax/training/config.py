"""What decides a training run's numbers: `TrainConfig`, whose defaults are README's main command."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..checks import finite_number, whole_number
from ..errors import CheckpointError, StarscreamError
from ..model.config import REMAT_POLICIES, ModelConfig
from ..model.catalog import load_model_config
from ..model.quantize import MATMUL_FORMATS
from ..sharding.layouts import PHASE_DEFAULTS
from .data import DEFAULT_CORPUS


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that decides a run's numbers. The defaults are the README's main command."""

    model: str = "tiny"
    layout: str = PHASE_DEFAULTS["train"]
    dtype: str = ""
    """Compute dtype; "" takes the model's own: --init's torch_dtype / dtype (bfloat16 stays bfloat16), else the
    model file's (float32 unless it says). Parameters and optimizer state stay float32 either way."""
    remat: str = "none"
    grad_accum: int = 1
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    final_learning_rate_fraction: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 100
    log_every: int = 10
    run_dir: str = "runs/train"
    data: str = str(DEFAULT_CORPUS)
    init: str = ""
    tokenizer: str = ""
    token_cache: str = "runs/token-cache"
    matmul_format: str = ""
    """"" (the projections compute in `dtype`) or the chip's e4m3 format for fp8 training (`--fp8`;
    `ModelConfig.matmul_format`)."""
    fp8_logits: bool = False
    """With `matmul_format`, the vocabulary projection in fp8 too (`--fp8-logits`; `ModelConfig.fp8_logits`)."""

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        """The TrainConfig a run description saved (`dataclasses.asdict`); fields this version lacks are dropped."""
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in values.items() if name in known})

    def data_files(self) -> list[str]:
        """The training files: `data` holds one path, or several separated by commas."""
        return [path for path in self.data.split(",") if path]

    def tokenizer_dir(self) -> str | None:
        """Where the tokenizer comes from: `tokenizer`, else `init` when it holds a tokenizer.json, else None (the
        byte-level tokenizer)."""
        if self.tokenizer:
            return self.tokenizer
        return self.init if self.init and (Path(self.init) / "tokenizer.json").is_file() else None

    def __post_init__(self):
        """Every count and rate is checked here, so that no run starts (or compiles) with a value it cannot use."""
        if isinstance(self.remat, bool):  # runs saved before remat policies say true / false
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if self.remat not in REMAT_POLICIES:
            raise StarscreamError(f"--remat-policy {self.remat!r}: use one of {', '.join(REMAT_POLICIES)}")
        if self.matmul_format not in ("", *MATMUL_FORMATS):
            raise StarscreamError(f"matmul_format {self.matmul_format!r}: use '' (the compute dtype) or one of "
                                  f"{', '.join(MATMUL_FORMATS)}")
        if self.fp8_logits and not self.matmul_format:
            raise StarscreamError("--fp8-logits computes the vocabulary projection in fp8 training's formats; pass it "
                                  "with --fp8")
        for field in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every", "eval_batches",
                      "checkpoint_every", "log_every"):
            whole_number(getattr(self, field), flag(field))
        if not self.data_files():
            raise StarscreamError(f"--data {self.data!r} names no file; pass one or more .txt or .jsonl files")
        for field in dataclasses.fields(self):  # "" would be the working directory, filled with the run's files
            if field.name in ("run_dir", "token_cache") and not getattr(self, field.name):
                raise StarscreamError(f"{flag(field.name)} '' names no directory; pass one such as {field.default}")
        if self.batch_size % self.grad_accum:
            raise StarscreamError(f"--grad-accum {self.grad_accum} does not split --batch-size {self.batch_size} "
                                  "into equal micro-batches; pass a divisor of the batch size")
        whole_number(self.warmup_steps, flag("warmup_steps"), minimum=0)
        whole_number(self.seed, flag("seed"), minimum=0)
        finite_number(self.learning_rate, flag("learning_rate"), positive=True)
        finite_number(self.clip_norm, flag("clip_norm"), positive=True)
        finite_number(self.weight_decay, flag("weight_decay"))
        if not 0 <= finite_number(self.final_learning_rate_fraction, "final_learning_rate_fraction") <= 1:
            raise StarscreamError(f"final_learning_rate_fraction {self.final_learning_rate_fraction}: must be in "
                                  "[0, 1] (the final learning rate as a fraction of the peak)")

    def model_config(self) -> ModelConfig:
        """The model this run trains: `init`'s config.json, else `model`, at the run's compute dtype, with the remat
        policy `remat` and the fp8 format `matmul_format` (with `fp8_logits`); its max_seq_len must hold `seq_len`."""
        if self.init and not (Path(self.init) / "config.json").is_file():
            found = "is not a directory" if not Path(self.init).is_dir() else "holds no config.json"
            raise CheckpointError(f"--init {self.init} {found}; pass a Hugging Face model directory (config.json, "
                                  "safetensors weights, tokenizer)")
        config = load_model_config(self.init or self.model, **({"dtype": self.dtype} if self.dtype else {}))
        if self.remat != "none":
            config = config.replace(remat=self.remat)
        if self.matmul_format:
            config = config.replace(matmul_format=self.matmul_format, fp8_logits=self.fp8_logits)
        if self.seq_len > config.max_seq_len:
            raise StarscreamError(f"--seq-len {self.seq_len} exceeds model {config.name}'s max_seq_len "
                                  f"{config.max_seq_len}; pass --seq-len {config.max_seq_len} or less")
        return config


FLAGS = {"matmul_format": "--fp8"}
"""The TrainConfig fields whose command-line flag is not their name's (--fp8 picks the chip's e4m3 format)."""


def flag(field: str) -> str:
    """The command-line flag of a TrainConfig field: "batch_size" -> "--batch-size"."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))
