"""Typed run configuration: `from swiftlite.config import X` for every public name.

- `schema.py`: the dataclasses (`RunConfig` and its sections (`SECTIONS`)), the constants, `field_specs()`.
- `load.py`: files, flags and env vars into a `RunConfig` (`load_config`, `build_config`, `coerce`),
  with ms-swift's derived defaults (accumulation, fp32 on a CPU build, --add_version's folder),
  `args.json` (`save_args`/`load_args`) and secret redaction. After `load_config` the user's config is
  never written: the run's concrete, sealed copy is swiftlite/job.py's `Resolved.config`.
- `msswift.py`: ms-swift flags and values that mean nothing here, each with what to use instead.
- `rules.py`: the generic validation rules (`validate`). Backend-specific combinations are checked
  by `swiftlite.parallel.resolve.resolve_backend`, which preflight runs before any process starts.

Import-light (no torch): the CLI imports this package to build `--help`.
"""

from swiftlite.config.load import (FALSE_WORDS, SECRET_KEY, TRUE_WORDS, alias_keys, apply_env, build_config,
                                   coerce, context_length, load_args, load_config, read_config_file,
                                   redact_secrets, save_args)
from swiftlite.config.rules import RULES, Rule, rule, validate
from swiftlite.config.schema import (DTYPES, SCHEDULERS, SECTIONS, STRATEGIES, TRAIN_TYPES, TRUNCATION,
                                     CheckpointConfig, DataConfig, FieldSpec, LoraConfig, ModelConfig,
                                     OptimConfig, ParallelConfig, QuantConfig, RlhfConfig, RunConfig, TrainConfig,
                                     field_reads, field_specs, opt, section_classes)
from swiftlite.errors import UserError

__all__ = [
    "CheckpointConfig", "DTYPES", "DataConfig", "FALSE_WORDS", "FieldSpec", "LoraConfig", "ModelConfig",
    "OptimConfig", "ParallelConfig", "QuantConfig", "RULES", "RlhfConfig", "Rule", "RunConfig", "SCHEDULERS", "SECRET_KEY",
    "SECTIONS", "STRATEGIES", "TRAIN_TYPES", "TRUE_WORDS", "TRUNCATION", "TrainConfig", "UserError", "alias_keys",
    "apply_env", "build_config", "coerce", "context_length", "field_reads", "field_specs", "load_args", "load_config",
    "opt",
    "read_config_file", "redact_secrets", "rule", "save_args", "section_classes", "validate",
]
