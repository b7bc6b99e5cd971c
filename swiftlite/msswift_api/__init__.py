"""The part of ms-swift's Python API that its plugin files use, as swiftlite provides it.

An ms-swift plugin file (`--external_plugins`, e.g. its examples/train/grpo/plugin/plugin.py) imports
more of ms-swift than the reward registry: inference engines and their request/response types for
generative judges, the `Template` a reward-model plugin encodes with, the reward-model plugin registry
(`rm_plugins`, its `DefaultRMPlugin` and `GenRMPlugin`), the multi-turn scheduler and gym registries,
and two helpers of swift.utils. While a plugin file's code runs (its load, and each call of a reward or
reward-model plugin it registered), those `swift.*` names resolve to the modules here
(swiftlite/plugin_imports.ALIASES): such a file loads unedited and what it registers lands where this run
looks.

What each module implements, and where it stops:
- protocol: the request and response dataclasses (fields a plugin reads or sets).
- engine: `TransformersEngine` over a loaded causal LM (transformers' generate, ms-swift's rules for the
  request's sampling settings and its default max_tokens).
- template: `Template.encode` / `data_collator` with the model's own chat template.
- rm_plugin: ms-swift's two built-in reward-model plugins and their registry.
- rollout: the registry of multi-turn schedulers and ms-swift's gym scheduler. A plugin's scheduler with
  ms-swift's turn hooks runs in GRPO (rlhf/plugin_turns.py drives it); one that overrides `run` samples
  through the engine rlhf/own_rollout.py gives it.
- gym_env: the gym environments' base class, ms-swift's `math_env` and their registry (`--gym_env`).
- utils: get_logger, to_device.
"""
